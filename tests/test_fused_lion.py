"""The fused 8-bit Lion step: compiled kernels bit-identical to the reference; the reference held to bitsandbytes.

- CPU kernel == reference, bit for bit (params, codes, absmax, fp32 momentum), over the random partitions
  of test_fused_step.py (8-bit and fp32 segments, short tails, all-zero blocks, huge/tiny/NaN/Inf gradients, three
  hyper rows, an unscale factor, bf16/fp16 gradients), starting from random codes, with momentum state that is
  already NaN/Inf, with an unsorted map (the portable path), and on values on and next to every midpoint of the map.
  Controls: every compared tensor changed (not two no-ops compared); an FMA-contracted momentum differs.
- The semantics by hand on four fp32-state elements (exact binary fractions): decoupled decay before the step, the
  direction from the old momentum, sign(0) = 0, a non-finite gradient skips the element — reference and kernel.
- reference vs bitsandbytes 0.50 Lion8bit (its CPU path): codes within one step of bnb's after one step; error
  against an exact fp64 Lion no worse than 1.1x bnb's own (max and mean); elements whose gradient is always zero
  never move (control: bnb's CPU path moves them by lr per step, as its quantizer cannot store 0 and sign(beta1 * m)
  is then +-1).
- CUDA: the kernel-vs-reference comparison runs where a GPU is present.
"""

from functools import partial

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import reference, rules
from deepspeed_bnb.ops.reference import LionHyper
from deepspeed_bnb.state_layout import GroupLayout
from test_fused_step import (QMAP1, Partition, _blocks_led_by_one, _kernel_vs_reference, _on_and_near_midpoints,
                             bits, needs_kernel)

SHUFFLED = QMAP1[torch.randperm(256, generator=torch.Generator().manual_seed(5))].contiguous()


class LionPartition(Partition):
    """test_fused_step's random partition with Lion's one state, starting from random codes and block scales."""

    RULE = "lion"
    NAMES = ("params", "codes1", "absmax1", "state1")

    def __init__(self, seed: int, device="cpu", grad_dtype=torch.float32, qmap=QMAP1, corrupt=False):
        super().__init__(seed, device=device, grad_dtype=grad_dtype)
        g, self.qmaps = self.generator, [qmap.to(device)]
        self.codes1 = torch.randint(0, 256, self.codes1.shape, generator=g, dtype=torch.uint8).to(device)
        self.absmax1 = (torch.rand(self.absmax1.shape, generator=g) * 1e-2).to(device)
        self.state1 = (torch.randn(self.state1.shape, generator=g) * 1e-3).to(device)
        if corrupt:  # state that is already non-finite (e.g. loaded from bnb's path, which lets NaN in)
            self.absmax1[1::5] = float("nan")
            self.absmax1[3::7] = float("inf")
            self.state1[::97] = float("nan")
            self.state1[5::89] = float("-inf")

    def hyper(self, step: int) -> torch.Tensor:
        rows = [LionHyper.lion(1e-4, 0.9, 0.99, 0.1), LionHyper.lion(3e-3, 0.95, 0.98, 0.0),
                LionHyper.lion(1e-3, 0.5, 0.9, 1.0)]
        return rules.hyper_table(rows).to(self.device)


def _check(device, seed, grad_dtype=torch.float32, kind=LionPartition):
    start, done = _kernel_vs_reference(device, seed, grad_dtype, kind)
    used = {"params"}  # not two no-ops compared: everything a segment uses has changed
    used |= {"codes1", "absmax1"} if any(s.eight_bit for s in start.segments) else set()
    used |= {"state1"} if not all(s.eight_bit for s in start.segments) else set()
    for name, before, after in zip(start.NAMES, start.tensors(), done.tensors()):
        assert name not in used or not torch.equal(bits(before.cpu()), bits(after.cpu())), name


@needs_kernel
@pytest.mark.parametrize("seed", range(12))
def test_cpu_kernel_bit_identical_to_reference(seed):
    _check("cpu", seed)


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision_gradients(grad_dtype):
    _check("cpu", 100, grad_dtype)


@needs_kernel
@pytest.mark.parametrize("seed", range(3))
def test_cpu_kernel_non_finite_state_and_unsorted_map(seed):
    """Momentum already NaN/Inf (sign 0 for NaN, first-NaN absmax); an unsorted map takes the portable full-block
    path, which the AVX-512 build otherwise skips."""
    _check("cpu", 200 + seed, kind=partial(LionPartition, corrupt=True))
    _check("cpu", 300 + seed, kind=partial(LionPartition, qmap=SHUFFLED))


def one_state_first_step_codes(rule, hyper, grads: torch.Tensor, qmap, use_kernel: bool) -> torch.Tensor:
    """codes1 after one step of a one-state rule ("lion" or "momentum") from zero state, with a hyper row under which
    m = g reaches the quantizer unchanged when every block's largest |g| is 1."""
    n = grads.numel()
    params, empty = torch.zeros(n), torch.zeros(0)
    codes1, absmax1 = torch.zeros(n, dtype=torch.uint8), torch.zeros(n // 256)
    table = rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0])
    rules.step_(rule, params, grads, [codes1], [absmax1], [empty], [qmap], table, hyper, 1.0, use_kernel=use_kernel)
    return codes1


def assert_midpoints_quantized_as_reference(first_step_codes, qmap):
    """Momenta on each midpoint of `qmap` and 1..256 ulps either side: the kernel's codes equal the reference's."""
    near = _on_and_near_midpoints(qmap, squared=False)
    grads = _blocks_led_by_one(near)
    assert torch.equal(first_step_codes(grads, qmap, True), first_step_codes(grads, qmap, False))
    # not vacuous: 255 momenta sat exactly on a midpoint, and one ulp above it is another code
    midpoints, _ = reference.quant_tables(qmap)
    assert int(torch.isin(near, midpoints).sum()) == 255
    per_value = first_step_codes(grads, qmap, False).view(-1, 256)[:, 1:].flatten()[:near.numel()].view(-1, 11)
    assert not torch.equal(per_value[:, 0], per_value[:, 1])


@needs_kernel
@pytest.mark.parametrize("qmap", [QMAP1, SHUFFLED], ids=["bnb map", "unsorted map"])
def test_cpu_kernel_quantizer_on_and_next_to_midpoints(qmap):
    hyper = rules.hyper_table([LionHyper.lion(1e-3, 0.9, 0.0, 0.0)])  # beta2 = 0: m = g
    assert_midpoints_quantized_as_reference(partial(one_state_first_step_codes, "lion", hyper), qmap)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
def test_semantics_by_hand(use_kernel):
    """lr 0.5, wd 0.25 (decay 0.875), beta1 0.5, beta2 0.75: every value below is exact in fp32."""
    layout = GroupLayout((4,), 1)
    params = torch.full((layout.partition_size,), 7.0)  # beyond element 4: alignment padding
    params[:4] = torch.tensor([1.0, -2.0, 4.0, 8.0])
    momentum = torch.tensor([1.0, 0.0, -1.0, 3.0])
    grads = torch.zeros(layout.partition_size)
    grads[:4] = torch.tensor([-1.5, 0.0, 1.0, float("nan")])
    table = rules.segment_table(layout.segments(0, [False]), [0])
    hyper = rules.hyper_table([LionHyper.lion(0.5, 0.5, 0.75, 0.25)])
    empty_codes, empty = torch.zeros(0, dtype=torch.uint8), torch.zeros(0)
    rules.step_("lion", params, grads, [empty_codes], [empty], [momentum], [QMAP1], table, hyper, 1.0,
                use_kernel=use_kernel)
    # 0: direction 0.5 - 0.75 < 0 from the *old* momentum (the new one, 0.375, is positive): 0.875 + 0.5
    # 1: direction 0, sign 0: decay only; 2: direction -0.5 + 0.5 = 0: decay only; 3: NaN gradient: untouched
    assert params[:4].tolist() == [1.375, -1.75, 3.5, 8.0]
    assert momentum.tolist() == [0.375, 0.0, -0.5, 3.0]
    assert (params[4:] == 7.0).all(), "alignment padding is never touched"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_kernel_bit_identical_to_reference(seed):
    _check("cuda", seed)
    _check("cuda", 200 + seed, kind=partial(LionPartition, corrupt=True))


def test_control_fma_contraction_is_detected():
    """The bar can fail: m = beta2 * m + (1 - beta2) * g rounded once instead of three times changes some results."""
    g, m = torch.randn(100000), torch.randn(100000)
    beta2, omb2 = torch.tensor(0.99), torch.tensor(0.01)
    separate = beta2 * m + omb2 * g
    fused = (beta2.double() * m.double() + omb2.double() * g.double()).float()
    assert not torch.equal(bits(separate), bits(fused))


# --- the reference against bitsandbytes ------------------------------------------------------------------------


def exact_lion(p, grads, lr, betas, wd):
    """fp64 Lion as bnb orders it (decoupled decay, then the signed step, then the momentum): the yardstick."""
    p, m = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        p = p * (1 - lr * wd) - lr * torch.sign(betas[0] * m + (1 - betas[0]) * g)
        m = betas[1] * m + (1 - betas[1]) * g
    return p


def run_both(n=8192, steps=20, unused_rows=False, seed=0):
    lr, betas, wd = 1e-3, (0.9, 0.99), 0.0 if unused_rows else 0.01
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 1e-2 for _ in range(steps)]
    if unused_rows:  # like embedding rows of tokens never seen: zero gradient, sharing blocks with used rows
        for grad in grads:
            grad.view(-1, 64)[1::3] = 0.0
    param = torch.nn.Parameter(start.clone())
    plain = bnb.optim.Lion8bit([param], lr=lr, betas=betas, weight_decay=wd, min_8bit_size=0)
    ours = start.clone()
    codes1, absmax1 = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n // 256)
    table = rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0])
    hyper = rules.hyper_table([LionHyper.lion(lr, *betas, wd)])
    for grad in grads:
        param.grad = grad.clone()
        plain.step()
        reference.lion8bit_step(ours, grad, codes1, absmax1, torch.zeros(0), QMAP1, table, hyper, 1.0)
    theirs = (param.detach(), plain.state[param]["state1"], plain.state[param]["absmax1"])
    return (ours, codes1, absmax1), theirs, exact_lion(start, grads, lr, betas, wd), start


def assert_codes_within_one_step(codes, bnb_codes):
    """One-state rules against bnb after one step: codes at most one sorted position apart, and not all equal."""
    rank = torch.argsort(torch.argsort(QMAP1))
    steps = (rank[codes.long()] - rank[bnb_codes.long()]).abs()
    assert steps.max() <= 1
    assert steps.any(), "control: bnb's CPU quantizer (a look-up table, ties down) differs from nearest somewhere"


def assert_error_no_worse_than_bnb(ours, theirs, exact, start):
    """Max and mean error against the exact fp64 run no worse than 1.1x bnb's, and small against the update."""
    our_error, bnb_error = (ours.double() - exact).abs(), (theirs.double() - exact).abs()
    assert our_error.max() <= 1.1 * bnb_error.max(), f"max: ours {our_error.max():.3e} vs bnb {bnb_error.max():.3e}"
    assert our_error.mean() <= 1.1 * bnb_error.mean(), f"mean: ours {our_error.mean():.3e} vs {bnb_error.mean():.3e}"
    assert our_error.mean() < 0.1 * (exact - start.double()).abs().mean(), "control: the error is small vs the update"


def test_reference_codes_within_one_step_of_bnb():
    (_, codes, absmax), (_, bnb_codes, bnb_absmax), _, _ = run_both(steps=1)
    assert torch.equal(absmax, bnb_absmax)  # m = (1 - beta2) * g, the same fp32 products
    assert_codes_within_one_step(codes, bnb_codes)


def test_reference_error_no_worse_than_bnb():
    (ours, _, _), (theirs, _, _), exact, start = run_both()
    assert_error_no_worse_than_bnb(ours, theirs, exact, start)


def test_zero_gradient_elements_never_move():
    """Elements whose gradient is always zero (an embedding row never used) keep their value, without weight decay."""
    (ours, _, _), (theirs, _, _), _, start = run_both(unused_rows=True)
    unused = torch.zeros(ours.numel(), dtype=torch.bool)
    unused.view(-1, 64)[1::3] = True
    assert torch.equal(ours[unused], start[unused])
    assert not torch.equal(ours[~unused], start[~unused]), "the others move"
    assert not torch.equal(theirs[unused], start[unused]), "control: bnb 0.50's CPU path moves them"
