"""The fused 8-bit SGD-with-momentum step: compiled kernels bit-identical to the reference; the reference held to
bitsandbytes' "momentum" rule (SGD8bit).

- CPU kernel == reference, bit for bit (params, codes, absmax, fp32 momentum), over the random partitions
  of test_fused_step.py (8-bit and fp32 segments, short tails, all-zero blocks, huge/tiny/NaN/Inf gradients, three
  hyper rows with and without weight decay, an unscale factor, bf16/fp16 gradients), from step 1 (m = g) and from
  later steps on random codes, with momentum state that is already NaN/Inf, with an unsorted map (the portable path),
  and on values on and next to every midpoint of the map. Controls: every compared tensor changed; an FMA-contracted
  momentum or update differs.
- The semantics by hand on four fp32-state elements (exact binary fractions): coupled weight decay, step 1 ignores
  the stored momentum, later steps beta1 * m + g, the update uses the new momentum, a non-finite gradient skips the
  element — reference and kernel.
- reference vs bitsandbytes 0.50 SGD8bit (its CPU path): codes within one step of bnb's after one step; error
  against an exact fp64 momentum SGD no worse than 1.1x bnb's own (max and mean); elements whose gradient is always
  zero never move (with a control on bnb's behaviour, see the test). bnb's dampening and nesterov are not used by its
  rule: the reference ignores them too (checked on bnb itself).
- CUDA: the kernel-vs-reference comparison runs where a GPU is present.
Run: pytest tests/test_fused_momentum.py (a few seconds once the extension is built).
"""

from functools import partial

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import reference, rules
from deepspeed_bnb.ops.reference import MomentumHyper
from deepspeed_bnb.state_layout import GroupLayout
from test_fused_lion import (SHUFFLED, LionPartition, assert_codes_within_one_step, assert_error_no_worse_than_bnb,
                             assert_midpoints_quantized_as_reference, one_state_first_step_codes)
from test_fused_step import QMAP1, _kernel_vs_reference, bits, needs_kernel


class MomentumPartition(LionPartition):
    """Lion's random one-state partition (random start codes and scales) with SGD-momentum hyper rows. `later`: start
    past step 1, so the random momentum is used from the first step on."""

    RULE = "momentum"

    def __init__(self, seed: int, later: bool = False, **kwargs):
        super().__init__(seed, **kwargs)
        self.later = later

    def hyper(self, step: int) -> torch.Tensor:
        step += 1 if self.later else 0
        rows = [MomentumHyper.momentum(1e-2, 0.9, 0.01, step), MomentumHyper.momentum(3e-3, 0.95, 0.0, step),
                MomentumHyper.momentum(1e-1, 0.5, 1e-4, step)]
        return rules.hyper_table(rows).to(self.device)


def _check(device, seed, grad_dtype=torch.float32, kind=MomentumPartition):
    start, done = _kernel_vs_reference(device, seed, grad_dtype, kind)
    used = {"params"}  # not two no-ops compared: everything a segment uses has changed
    used |= {"codes1", "absmax1"} if any(s.eight_bit for s in start.segments) else set()
    used |= {"state1"} if not all(s.eight_bit for s in start.segments) else set()
    for name, before, after in zip(start.NAMES, start.tensors(), done.tensors()):
        assert name not in used or not torch.equal(bits(before.cpu()), bits(after.cpu())), name


@needs_kernel
@pytest.mark.parametrize("seed", range(8))
def test_cpu_kernel_bit_identical_to_reference(seed):
    _check("cpu", seed, kind=partial(MomentumPartition, later=bool(seed % 2)))


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision_gradients(grad_dtype):
    _check("cpu", 100, grad_dtype)


@needs_kernel
@pytest.mark.parametrize("seed", range(2))
def test_cpu_kernel_non_finite_state_and_unsorted_map(seed):
    """Momentum already NaN/Inf (first-NaN absmax); an unsorted map takes the portable full-block path."""
    _check("cpu", 200 + seed, kind=partial(MomentumPartition, later=True, corrupt=True))
    _check("cpu", 300 + seed, kind=partial(MomentumPartition, later=True, qmap=SHUFFLED))


@needs_kernel
@pytest.mark.parametrize("qmap", [QMAP1, SHUFFLED], ids=["bnb map", "unsorted map"])
def test_cpu_kernel_quantizer_on_and_next_to_midpoints(qmap):
    hyper = rules.hyper_table([MomentumHyper.momentum(1e-3, 0.9, 0.0, 1)])  # step 1, no weight decay: m = g
    assert_midpoints_quantized_as_reference(partial(one_state_first_step_codes, "momentum", hyper), qmap)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
@pytest.mark.parametrize("step", [1, 2])
def test_semantics_by_hand(use_kernel, step):
    """lr 0.5, momentum 0.5, wd 0.25: every value below is exact in fp32."""
    layout = GroupLayout((4,), 1)
    params = torch.full((layout.partition_size,), 7.0)  # beyond element 4: alignment padding
    params[:4] = torch.tensor([1.0, -2.0, 4.0, 8.0])
    momentum = torch.tensor([1.0, 0.0, -1.0, 3.0])
    grads = torch.zeros(layout.partition_size)
    grads[:4] = torch.tensor([-1.5, 0.0, 1.0, float("nan")])
    table = rules.segment_table(layout.segments(0, [False]), [0])
    hyper = rules.hyper_table([MomentumHyper.momentum(0.5, 0.5, 0.25, step)])
    empty_codes, empty = torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    rules.step_("momentum", params, grads, [empty_codes], [empty], [momentum], [QMAP1], table, hyper, 1.0,
                use_kernel=use_kernel)
    # g' = g + 0.25 p = [-1.25, -0.5, 2, (NaN: skipped)]; step 1: m = g'; step 2: m = 0.5 m_old + g'; p -= 0.5 m
    if step == 1:
        assert momentum.tolist() == [-1.25, -0.5, 2.0, 3.0]
        assert params[:4].tolist() == [1.625, -1.75, 3.0, 8.0]
    else:
        assert momentum.tolist() == [-0.75, -0.5, 1.5, 3.0]
        assert params[:4].tolist() == [1.375, -1.75, 3.25, 8.0]
    assert (params[4:] == 7.0).all(), "alignment padding is never touched"


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
def test_no_weight_decay_term_without_weight_decay(use_kernel):
    """wd = 0 adds nothing (bnb: `if weight_decay > 0`): an infinite parameter with a zero gradient keeps a zero
    momentum instead of 0 * inf = NaN."""
    layout = GroupLayout((2,), 1)
    params = torch.zeros(layout.partition_size)
    params[:2] = torch.tensor([float("inf"), 1.0])
    momentum, grads = torch.zeros(2), torch.zeros(layout.partition_size)
    table = rules.segment_table(layout.segments(0, [False]), [0])
    hyper = rules.hyper_table([MomentumHyper.momentum(0.5, 0.5, 0.0, 2)])
    rules.step_("momentum", params, grads, [torch.zeros(0, dtype=torch.uint8)], [torch.zeros(0)], [momentum],
                [QMAP1], table, hyper, 1.0, use_kernel=use_kernel)
    assert momentum.tolist() == [0.0, 0.0] and params[:2].tolist() == [float("inf"), 1.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_kernel_bit_identical_to_reference(seed):
    _check("cuda", seed, kind=partial(MomentumPartition, later=bool(seed % 2)))
    _check("cuda", 200 + seed, kind=partial(MomentumPartition, later=True, corrupt=True))


def test_control_fma_contraction_is_detected():
    """The bar can fail: beta1 * m + g and p - lr * m each rounded once instead of twice change some results."""
    g, m, p = torch.randn(100000), torch.randn(100000), torch.randn(100000)
    beta1, lr = torch.tensor(0.9), torch.tensor(0.01)
    assert not torch.equal(bits(beta1 * m + g), bits((beta1.double() * m.double() + g.double()).float()))
    assert not torch.equal(bits(p - lr * m), bits((p.double() - lr.double() * m.double()).float()))


# --- the reference against bitsandbytes ------------------------------------------------------------------------


def exact_momentum(p, grads, lr, beta1, wd):
    """fp64 SGD with momentum as bnb defines it (coupled decay, m = g at step 1): the yardstick."""
    p, m = p.double().clone(), None
    for g in grads:
        g = g.double() + wd * p
        m = g if m is None else beta1 * m + g
        p = p - lr * m
    return p


def run_both(n=8192, steps=20, unused_rows=False, seed=0, **bnb_extra):
    lr, beta1, wd = 1e-2, 0.9, 0.0 if unused_rows else 0.01
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 1e-1 for _ in range(steps)]
    if unused_rows:  # like embedding rows of tokens never seen: zero gradient, sharing blocks with used rows
        for grad in grads:
            grad.view(-1, 64)[1::3] = 0.0
    param = torch.nn.Parameter(start.clone())
    plain = bnb.optim.SGD8bit([param], lr=lr, momentum=beta1, weight_decay=wd, min_8bit_size=0, **bnb_extra)
    ours = start.clone()
    codes1, absmax1 = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n // 256)
    table = rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0])
    for t, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        plain.step()
        hyper = rules.hyper_table([MomentumHyper.momentum(lr, beta1, wd, t)])
        reference.momentum8bit_step(ours, grad, codes1, absmax1, torch.zeros(0), QMAP1, table, hyper, 1.0)
    theirs = (param.detach(), plain.state[param]["state1"], plain.state[param]["absmax1"])
    return (ours, codes1, absmax1), theirs, exact_momentum(start, grads, lr, beta1, wd), start


def test_reference_codes_within_one_step_of_bnb():
    (_, codes, absmax), (_, bnb_codes, bnb_absmax), _, _ = run_both(steps=1)
    torch.testing.assert_close(absmax, bnb_absmax, rtol=1e-6, atol=0)  # m = g + wd * p (bnb may fuse the add)
    assert_codes_within_one_step(codes, bnb_codes)


def test_reference_error_no_worse_than_bnb():
    (ours, _, _), (theirs, _, _), exact, start = run_both()
    assert_error_no_worse_than_bnb(ours, theirs, exact, start)


def test_bnb_ignores_dampening_and_nesterov():
    """bnb's "momentum" rule never reads dampening or nesterov (nor does the reference): same weights either way."""
    (_, _, _), (plain, _, _), _, _ = run_both(steps=3)
    (_, _, _), (other, _, _), _, _ = run_both(steps=3, dampening=0.5, nesterov=True)
    assert torch.equal(plain, other)


def test_zero_gradient_elements_never_move():
    """Elements whose gradient is always zero (an embedding row never used) keep their value (no weight decay)."""
    (ours, codes, _), (theirs, bnb_codes, _), _, start = run_both(unused_rows=True)
    unused = torch.zeros(ours.numel(), dtype=torch.bool)
    unused.view(-1, 64)[1::3] = True
    assert torch.equal(ours[unused], start[unused])
    assert (QMAP1[codes[unused].long()] == 0).all(), "their momentum is stored as exactly 0"
    assert not torch.equal(ours[~unused], start[~unused]), "the others move"
    assert not torch.equal(theirs[unused], start[unused]), "control: bnb 0.50's CPU path moves them"
