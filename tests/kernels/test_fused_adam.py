"""The fused 8-bit AdamW step's own checks (what every rule shares, kernel and reference alike: test_fused_rules.py).

- The rebuilt dynamic map (reference.dynamic_map, for machines without bitsandbytes: tests/support/cuda_kernel_run.py)
  is bnb's, bit for bit. Control: the other map differs.
- A positive second moment far below its block's absmax is never stored as 0: no update grows beyond bnb's own CPU
  update's from the same start, and the kernel applies the same floor bit for bit. Control: with nearest rounding
  only, those v are stored as 0 and the next step moves the element by many times lr.
"""

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import reference
from deepspeed_bnb.ops.reference import AdamHyper
from support.kernel_harness import KERNEL, QMAPS, Whole, assert_bit_identical


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bnbs(signed):
    ours, theirs = reference.dynamic_map(signed), bnb.functional.create_dynamic_map(signed=signed)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert not torch.equal(reference.dynamic_map(not signed), theirs)  # control: the other map differs


def _small_second_moment_run(use_kernel: bool, steps: int = 3):
    """Steps of 16 blocks where, in each block, one element's gradient is 1e-5 of the others' (an attention weight
    next to busy ones): per step, the largest |update| / lr, and the state after the last step."""
    lr, n = 1e-3, 4096
    g = torch.Generator().manual_seed(7)
    part = Whole("adam", torch.randn(n, generator=g), lambda t: AdamHyper.adamw(lr, 0.9, 0.999, 1e-8, 0.0, t))
    ratios = []
    for t in range(1, steps + 1):
        grads = torch.randn(n, generator=g).abs() + 0.5
        grads[::256] = 1e-5 * grads[::256]
        before = part.params.clone()
        part.step(t, grads, use_kernel, 1.0)
        ratios.append(float((part.params - before).abs().max()) / lr)
    return ratios, part


def test_small_second_moment_never_stored_as_zero(monkeypatch):
    """A positive second moment far below its block's absmax keeps the smallest positive code (not 0's), so the next
    step divides by the v accumulated so far: no update grows beyond bnb's own CPU update's from the same start
    (bnb CPU never stores 0 for a positive v). Control: nearest rounding alone stores those v as 0 and the next step
    moves the element by many times lr."""
    qmap2 = QMAPS[1]
    ratios, part = _small_second_moment_run(use_kernel=False)
    small = torch.zeros(4096, dtype=torch.bool)
    small[::256] = True
    assert (qmap2[part.codes2.long()][small] > 0).all()
    param = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(7)))
    plain = bnb.optim.AdamW8bit([param], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, min_8bit_size=0)
    g = torch.Generator().manual_seed(7)
    torch.randn(4096, generator=g)  # the start, drawn as above
    bnb_ratios = []
    for _ in range(3):
        grads = torch.randn(4096, generator=g).abs() + 0.5
        grads[::256] = 1e-5 * grads[::256]
        before = param.detach().clone()
        param.grad = grads
        plain.step()
        bnb_ratios.append(float((param.detach() - before).abs().max()) / 1e-3)
    assert max(ratios) <= 1.05 * max(bnb_ratios), (ratios, bnb_ratios)
    if KERNEL:  # the compiled kernel applies the same floor, bit for bit
        _, kernel = _small_second_moment_run(use_kernel=True)
        assert_bit_identical(kernel, part, "small second moments")
    monkeypatch.setattr(reference, "positive_floor", lambda qmap: (-1, -1))  # control: nearest rounding only
    nearest, unfloored = _small_second_moment_run(use_kernel=False)
    assert (qmap2[unfloored.codes2.long()][small] == 0).all()
    assert max(nearest) > 2 * max(bnb_ratios), (nearest, bnb_ratios)  # measured: 3.9 x lr against 1.02
