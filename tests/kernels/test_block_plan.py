"""The CPU kernels' walk over a partition's blocks (csrc/cpu/fused_cpu.h: BlockPlan, for_each_block): ATen's thread
pool hands out chunks of 16 blocks, and each chunk finds the segment it starts in from the segments' block counts.

Reference: the pure-torch reference (ops/reference.py) of the same steps. Over a partition of many segments (8-bit and
32-bit state interleaved, 1 to 20,000 elements: chunks start inside segments, on their first blocks and past the 8-bit
segments the 'bnb_cpu' arithmetic's first pass leaves out), the kernel at 1, 2, 3 and 7 threads equals the reference
bit for bit after every step, for every rule, in both CPU arithmetics. Controls: the weights moved, and at 3 and 7
threads some chunks do start inside a segment.
"""

import bitsandbytes.functional as F
import pytest
import torch

from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.state_layout import GroupLayout
from support.kernel_harness import needs_kernel

pytestmark = needs_kernel

CONFIGS = {"adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
           "lion": {"lr": 1e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01},
           "momentum": {"lr": 1e-2, "betas": (0.9, 0.0), "eps": 1e-8, "weight_decay": 0.01}}
NUMELS = (1, 3000, 255, 257, 17, 2048, 4099, 1, 700, 256, 1500, 9, 20000, 5000, 333, 9000)
EIGHT_BIT = tuple(i % 3 != 1 for i in range(len(NUMELS)))  # every third one 32-bit
GRAIN = 16  # for_each_block's chunk, in blocks


def _state(rule: str, seed: int):
    """Zero state of the partition (one rank of DP 1: every segment here), its segment table and random weights."""
    update = rules.get(rule)
    layout = GroupLayout(NUMELS, 1)
    segments = layout.segments(0, EIGHT_BIT)
    g = torch.Generator().manual_seed(seed)
    size = layout.partition_size
    signed = rules.SIGNED_MAPS[:update.moments]
    return {"params": torch.randn(size, generator=g),
            "codes": [torch.full((size,), 127 if s else 0, dtype=torch.uint8) for s in signed],
            "absmax": [torch.zeros(size // 256) for _ in signed],
            "state": [torch.zeros(layout.fp32_numel(0, EIGHT_BIT)) for _ in signed],
            "qmaps": [F.create_dynamic_map(s) for s in signed],
            "table": rules.segment_table(segments, [0] * len(segments)),
            "segments": segments, "generator": g}


def _tensors(s) -> list:
    return [s["params"], *s["codes"], *s["absmax"], *s["state"]]


def _steps(rule: str, arithmetic: str, threads, seed=0, steps=3) -> list:
    """The tensors after each of `steps` steps: by the kernel at `threads` threads, or the reference (None)."""
    s = _state(rule, seed)
    update, out = rules.get(rule), []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or before)
        for step in range(1, steps + 1):
            grads = torch.randn(s["params"].numel(), generator=s["generator"]) * 1e-2
            hyper = update.rows([CONFIGS[rule]], step, arithmetic)
            rules.step_(update, s["params"], grads, s["codes"], s["absmax"], s["state"], s["qmaps"], s["table"],
                        hyper, 0.5, arithmetic=arithmetic, use_kernel=threads is not None)
            out.append([t.clone() for t in _tensors(s)])
    finally:
        torch.set_num_threads(before)
    return out


def _chunk_starts_inside_a_segment(segments, threads: int) -> bool:
    """Whether ATen's split of the blocks among `threads` starts a chunk inside a segment (not on its first block):
    at::parallel_for gives each of min(threads, ceil(blocks / grain)) threads ceil(blocks / that) blocks."""
    firsts, blocks = set(), 0
    for s in segments:
        firsts.add(blocks)
        blocks += -(-s.numel // 256)
    chunk = -(-blocks // min(threads, -(-blocks // GRAIN)))
    return any(start not in firsts for start in range(0, blocks, chunk))


@pytest.mark.parametrize("arithmetic", [rules.IEEE, rules.BNB_CPU])
@pytest.mark.parametrize("rule", list(rules.RULES))
def test_every_thread_count_gives_the_references_bits(rule, arithmetic):
    expected = _steps(rule, arithmetic, None)
    for threads in (1, 2, 3, 7):
        for step, (got, want) in enumerate(zip(_steps(rule, arithmetic, threads), expected), 1):
            for k, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(bits(a), bits(b)), f"{rule}, {arithmetic}, {threads} threads, step {step}, #{k}"
    assert not torch.equal(expected[-1][0], _state(rule, 0)["params"])  # control: the weights moved


def test_control_chunks_start_inside_segments():
    segments = _state("adam", 0)["segments"]
    assert len(segments) == len(NUMELS) and sum(-(-s.numel // 256) for s in segments) > 7 * GRAIN
    assert _chunk_starts_inside_a_segment(segments, 3) and _chunk_starts_inside_a_segment(segments, 7)
