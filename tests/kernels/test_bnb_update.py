"""The bnb_cuda arithmetic's oracle (deepspeed_bnb/ops/bnb_update.py) is bitsandbytes' own update, with the fused
operators' argument layout: a flat partition stepped by it equals plain bnb optimizers stepping the same parameters
one by one, bit for bit (weights, codes, absmax and fp32 state), for every fused rule, 8-bit and 32-bit state, fp32 and
bf16 weights, with and without DeepSpeed's unscale factor.

On this CPU bnb's update is its CPU path, so this holds the oracle's plumbing (segment slicing, argument order, the
hyper rows, the unscale factor) to bnb; on a GPU the same oracle calls bnb's CUDA kernels, which the fused bnb_cuda
kernels are held to there (the first-use check, ops/self_check.py, and the GPU proof). The hyper-parameters are
exact in fp32: the rows carry bnb's kernel arguments as fp32 (its CUDA path rounds them so), while its CPU path
computes with the Python doubles. Controls: a wrong learning rate in the rows, and a missing unscale factor, both
differ.
"""

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.state_layout import GroupLayout

NUMELS = (1300, 300, 2100)  # 8-bit, 32-bit (min_8bit_size=1000), 8-bit with a tail block
M = dict(min_8bit_size=1000)
OPTIMIZERS = {  # every hyper-parameter a dyadic fraction: the same value in fp32 and fp64
    "adam": lambda p: bnb.optim.AdamW8bit(p, lr=2 ** -10, betas=(0.875, 1 - 2 ** -10), eps=2 ** -27,
                                          weight_decay=2 ** -4, **M),
    "lion": lambda p: bnb.optim.Lion8bit(p, lr=2 ** -13, betas=(0.875, 0.9921875), weight_decay=2 ** -3, **M),
    "momentum": lambda p: bnb.optim.SGD8bit(p, lr=2 ** -7, momentum=0.875, weight_decay=2 ** -5, **M),
}
STEPS = 4


def _grads(step: int, dtype) -> list:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(n, generator=g) * 10.0 ** (-step)).to(dtype) for n in NUMELS]


def _run(rule: str, dtype, inv_scale=None, lr_factor=1.0):
    """(plain bnb's parameters and states, the oracle's partition) after STEPS steps."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, generator=g).to(dtype) for n in NUMELS]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    plain = OPTIMIZERS[rule](params)
    layout = GroupLayout(NUMELS, 1)
    eight_bit = [n >= 1000 for n in NUMELS]
    segments = layout.segments(0, eight_bit)
    flat = torch.zeros(layout.partition_size, dtype=dtype)
    for slot, w in zip(layout.slots, weights):
        flat.narrow(0, slot.offset, slot.numel).copy_(w)
    moments = rules.get(rule).moments
    size, fp32 = layout.partition_size, layout.fp32_numel(0, eight_bit)
    codes = [torch.zeros(size, dtype=torch.uint8) for _ in range(moments)]  # bnb's init_state: zeros
    absmax = [torch.zeros(size // 256) for _ in range(moments)]
    state = [torch.zeros(fp32) for _ in range(moments)]
    qmaps = [bnb.functional.create_dynamic_map(signed=s) for s in rules.SIGNED_MAPS[:moments]]
    table = rules.segment_table(segments, [0] * len(segments))
    for step in range(1, STEPS + 1):
        grads = _grads(step, dtype)
        for p, grad in zip(params, grads):
            p.grad = grad.clone() if inv_scale is None else grad.clone().mul_(inv_scale)  # what DeepSpeed's mul_ does
        plain.step()
        flat_grads = torch.zeros_like(flat)
        for slot, grad in zip(layout.slots, grads):
            flat_grads.narrow(0, slot.offset, slot.numel).copy_(grad)
        config = dict(plain.get_config(0, 0, plain.param_groups[0]))
        config["lr"] *= lr_factor  # lr_factor 1.01: a wrong row (the control)
        hyper = rules.get(rule).rows([config], step, rules.BNB_CUDA)
        rules.step_(rule, flat, flat_grads, codes, absmax, state, qmaps, table, hyper, inv_scale, None,
                    rules.BNB_CUDA, use_kernel=False)
    return params, plain, (layout, segments, flat, codes, absmax, state)


def _differences(params, plain, partition) -> list:
    layout, segments, flat, codes, absmax, state = partition
    found = []
    for segment, slot, p in zip(segments, layout.slots, params):
        if not torch.equal(bits(flat.narrow(0, slot.offset, slot.numel)), bits(p.detach())):
            found.append(f"weights of parameter {segment.slot}")
        theirs = plain.state[p]
        for k in range(len(codes)):
            if segment.eight_bit:
                mine = {"codes": codes[k].narrow(0, segment.offset, segment.numel),
                        "absmax": absmax[k].narrow(0, segment.first_block, segment.blocks)}
                expected = {"codes": theirs[f"state{k + 1}"], "absmax": theirs[f"absmax{k + 1}"]}
            else:
                mine = {"state": state[k].narrow(0, segment.fp32_offset, segment.numel)}
                expected = {"state": theirs[f"state{k + 1}"]}
            for name in mine:
                if not torch.equal(bits(mine[name]), bits(expected[name])):
                    found.append(f"{name}{k + 1} of parameter {segment.slot}")
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", sorted(OPTIMIZERS))
def test_oracle_is_plain_bnb(rule, dtype):
    assert _differences(*_run(rule, dtype)) == []


@pytest.mark.parametrize("rule", sorted(OPTIMIZERS))
def test_oracle_applies_the_unscale_factor_as_deepspeed(rule):
    factor = torch.tensor(1 / 3.7)
    assert _differences(*_run(rule, torch.float32, inv_scale=factor)) == []


def test_controls_a_wrong_row_or_a_lost_factor_differ():
    assert _differences(*_run("adam", torch.float32, lr_factor=1.01))
    params, plain, partition = _run("adam", torch.float32, inv_scale=torch.tensor(0.5))
    layout, segments, flat, *state = partition
    unscaled = _run("adam", torch.float32)[2]
    assert not torch.equal(bits(flat), bits(unscaled[2]))  # the factor reached the update
