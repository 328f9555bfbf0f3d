"""The fused 8-bit AdamW step: compiled kernels bit-identical to the reference; the reference held to bitsandbytes.

- CPU kernel == reference, bit for bit (params, codes, absmax, fp32 state), over random partitions with
  8-bit and fp32 segments, tails that are not a multiple of 256, all-zero blocks, huge and tiny gradients, NaN/Inf,
  several hyper-parameter rows, an unscale factor, bf16 gradients; several steps each. Control: an FMA-contracted
  variant of the arithmetic (what a careless build would do) differs from the reference, so the bar can fail.
- reference vs bitsandbytes 0.50 (its CPU path): codes within one step of bnb's; error against an exact fp64 AdamW no
  worse than 1.1x bnb's own; elements whose gradient is always zero never move (bnb's CPU path drifts them: it
  cannot store 0, so m = 0 comes back as ~2e-5 * absmax).
- CUDA: the same comparisons run where a GPU is present. (torch.library.opcheck of every operator: test_rules.py.)
"""

import math

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import loader, reference, rules
from deepspeed_bnb.ops.reference import AdamHyper
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.state_layout import GroupLayout

QMAP1 = bnb.functional.create_dynamic_map(signed=True)
QMAP2 = bnb.functional.create_dynamic_map(signed=False)
KERNEL = loader.load()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")


class Partition:
    """A random partition: several parameters (8-bit and fp32), their segment table and the state of RULE."""

    RULE = "adam"
    NAMES = ("params", "codes1", "codes2", "absmax1", "absmax2", "state1", "state2")  # what a step updates

    def __init__(self, seed: int, device="cpu", dp=3, rank=1, grad_dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        count = int(torch.randint(2, 7, (1,), generator=g))
        numels = tuple(int(n) for n in torch.randint(1, 5000, (count,), generator=g))
        eight_bit = [bool(b) for b in torch.rand(count, generator=g) < 0.7]
        layout = GroupLayout(numels, dp)
        rank = min(rank, dp - 1)
        self.segments = layout.segments(rank, eight_bit)
        size, fp32 = layout.partition_size, layout.fp32_numel(rank, eight_bit)
        self.rows = [int(r) for r in torch.randint(0, 3, (len(self.segments),), generator=g)]
        self.params = torch.randn(size, generator=g).to(device)
        self.codes1 = torch.full((size,), 127, dtype=torch.uint8, device=device)
        self.codes2 = torch.zeros(size, dtype=torch.uint8, device=device)
        self.absmax1 = torch.zeros(size // 256, device=device)
        self.absmax2 = torch.zeros(size // 256, device=device)
        self.state1 = torch.zeros(fp32, device=device)
        self.state2 = torch.zeros(fp32, device=device)
        self.qmaps = [QMAP1.to(device), QMAP2.to(device)]
        self.generator, self.device, self.grad_dtype = g, device, grad_dtype
        self.table = rules.segment_table(self.segments, self.rows).to(device)

    def grads(self, step: int) -> torch.Tensor:
        g = self.generator
        grads = torch.randn(self.params.numel(), generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g))
        grads[:300] = 0.0  # an all-zero block (and a zero stretch)
        if step % 2:
            grads[torch.randint(0, grads.numel(), (5,), generator=g)] = float("nan")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = float("inf")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 3e19  # g * g overflows fp32
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 1e-30
        return grads.to(self.grad_dtype).to(self.device)

    def hyper(self, step: int) -> torch.Tensor:
        rows = [AdamHyper.adamw(1e-3, 0.9, 0.999, 1e-8, 0.01, step), AdamHyper.adamw(3e-2, 0.8, 0.95, 1e-6, 0.0, step),
                AdamHyper.adamw(1e-4, 0.9, 0.99, 1e-8, 0.1, step)]
        return rules.hyper_table(rows).to(self.device)

    def tensors(self):
        return tuple(getattr(self, name) for name in self.NAMES)

    def clone(self):
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        for name in self.NAMES:
            setattr(other, name, getattr(self, name).clone())
        return other

    def step(self, step: int, grads, use_kernel: bool, inv_scale: float):
        moments = range(1, rules.get(self.RULE).moments + 1)
        rules.step_(self.RULE, self.params, grads, *([getattr(self, f"{kind}{k}") for k in moments]
                                                     for kind in ("codes", "absmax", "state")),
                    self.qmaps, self.table, self.hyper(step), inv_scale, use_kernel=use_kernel)


def assert_bit_identical(a: Partition, b: Partition, context: str):
    for name, x, y in zip(a.NAMES, a.tensors(), b.tensors()):
        x, y = bits(x.cpu()), bits(y.cpu())
        if not torch.equal(x, y):
            where = (x != y).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"{context}: {name} differs at {where} (of {int((x != y).sum())}): "
                                 f"{[x[i].item() for i in where]} vs {[y[i].item() for i in where]}")


def _kernel_vs_reference(device, seed, grad_dtype=torch.float32, kind=Partition):
    """Four steps of a random `kind` partition by the kernel and by the reference, compared after each; returns the
    starting partition and the kernel's."""
    kernel = kind(seed, device=device, grad_dtype=grad_dtype)
    start, ref = kernel.clone(), kernel.clone()
    for step in range(1, 5):
        grads = kernel.grads(step)
        inv_scale = 1.0 if step < 3 else 1 / 3.7
        kernel.step(step, grads, True, inv_scale)
        ref.step(step, grads, False, inv_scale)
        assert_bit_identical(kernel, ref, f"seed {seed}, step {step}")
    return start, kernel


@needs_kernel
@pytest.mark.parametrize("seed", range(12))
def test_cpu_kernel_bit_identical_to_reference(seed):
    _kernel_vs_reference("cpu", seed)


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision_gradients(grad_dtype):
    _kernel_vs_reference("cpu", 100, grad_dtype)


def _on_and_near_midpoints(qmap: torch.Tensor, squared: bool) -> torch.Tensor:
    """Values on each midpoint of the map and 1, 2, 100, 255 and 256 ulps either side; their square roots when the
    kernel will see them squared (the second moment)."""
    midpoints, _ = reference.quant_tables(qmap)
    if squared:
        midpoints = midpoints[midpoints > 0].sqrt()
    mid_bits = midpoints.view(torch.int32)
    offsets = torch.tensor([0, 1, -1, 2, -2, 100, -100, 255, -255, 256, -256], dtype=torch.int32)
    return (mid_bits[:, None] + offsets[None, :]).flatten().view(torch.float32)


def _first_step_codes(grads: torch.Tensor, qmap1, qmap2, use_kernel: bool, device="cpu"):
    """(codes1, codes2) after one step from zero state with beta1 = beta2 = 0: m = g and v = g * g reach the
    quantizer unchanged when every block's largest |g| is 1 (absmax 1, so normalizing is exact)."""
    n = grads.numel()
    params, empty = torch.zeros(n, device=device), torch.zeros(0, device=device)
    codes = [torch.full((n,), 127, dtype=torch.uint8, device=device), torch.zeros(n, dtype=torch.uint8, device=device)]
    absmax = [torch.zeros(n // 256, device=device), torch.zeros(n // 256, device=device)]
    table = rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0]).to(device)
    rows = rules.hyper_table([AdamHyper.adamw(1e-3, 0.0, 0.0, 1e-8, 0.0, 1)]).to(device)
    rules.step_("adam", params, grads.to(device), codes, absmax, [empty, empty], [qmap1.to(device), qmap2.to(device)],
                table, rows, 1.0, use_kernel=use_kernel)
    return codes[0].cpu(), codes[1].cpu()


def _blocks_led_by_one(values: torch.Tensor) -> torch.Tensor:
    """255 values per 256-element block, each block starting with 1.0 (its absmax)."""
    blocks = -(-values.numel() // 255)
    grads = torch.zeros(blocks, 256)
    grads[:, 0] = 1.0
    body = torch.zeros(blocks * 255)
    body[:values.numel()] = values
    grads[:, 1:] = body.view(blocks, 255)
    return grads.flatten()


def _check_midpoints(device, shuffled):
    """Values on a midpoint round to the lower entry, values 1..256 ulps away to their side, as in the reference:
    the case where a quantizer that compares fewer than all 32 bits (the CPU's packed key table) could go wrong.
    Unsorted maps (codes are not sorted positions) take the CPU's portable path."""
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(5)) if shuffled else torch.arange(256)
    qmap1, qmap2 = QMAP1[perm].contiguous(), QMAP2[perm].contiguous()
    near1 = _on_and_near_midpoints(qmap1, squared=False)  # m = g lands on qmap1's midpoints
    near2 = _on_and_near_midpoints(qmap2, squared=True)  # v = g * g lands within a few ulps of qmap2's
    for values in (near1, near2):
        grads = _blocks_led_by_one(values)
        kernel = _first_step_codes(grads, qmap1, qmap2, True, device)
        ref = _first_step_codes(grads, qmap1, qmap2, False, device)
        assert torch.equal(kernel[0], ref[0]) and torch.equal(kernel[1], ref[1])
    # not vacuous: 255 of the first moments sat exactly on a midpoint, and one ulp above it is another code
    midpoints, _ = reference.quant_tables(qmap1)
    assert int(torch.isin(near1, midpoints).sum()) == 255
    codes = _first_step_codes(_blocks_led_by_one(near1), qmap1, qmap2, False)[0]
    per_value = codes.view(-1, 256)[:, 1:].flatten()[:near1.numel()].view(-1, 11)
    assert not torch.equal(per_value[:, 0], per_value[:, 1])


@needs_kernel
@pytest.mark.parametrize("shuffled", [False, True], ids=["bnb maps", "unsorted maps"])
def test_cpu_kernel_quantizer_on_and_next_to_midpoints(shuffled):
    _check_midpoints("cpu", shuffled)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@needs_cuda
@pytest.mark.parametrize("seed", range(6))
def test_cuda_kernel_bit_identical_to_reference(seed):
    _kernel_vs_reference("cuda", seed)


@needs_cuda
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_low_precision_gradients(grad_dtype):
    _kernel_vs_reference("cuda", 100, grad_dtype)


@needs_cuda
@pytest.mark.parametrize("shuffled", [False, True], ids=["bnb maps", "unsorted maps"])
def test_cuda_kernel_quantizer_on_and_next_to_midpoints(shuffled):
    _check_midpoints("cuda", shuffled)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_is_bnbs(signed):
    """The rebuilt map (for machines without bitsandbytes: tests/cuda_kernel_run.py) is bnb's, bit for bit."""
    ours, theirs = reference.dynamic_map(signed), bnb.functional.create_dynamic_map(signed=signed)
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))
    assert not torch.equal(reference.dynamic_map(not signed), theirs)  # control: the other map differs


def test_control_fma_contraction_is_detected():
    """The harness can fail: fusing v = beta2 * v + (1 - beta2) * g * g into one rounding changes some results."""
    g = torch.randn(100000, dtype=torch.float64)
    v = torch.rand(100000, dtype=torch.float64)
    beta2, omb2 = torch.tensor(0.999), torch.tensor(0.001)
    separate = beta2 * v.float() + omb2 * (g.float() * g.float())
    fused = (beta2.double() * v.float().double() + omb2.double() * (g.float().double() ** 2)).float()
    assert not torch.equal(bits(separate), bits(fused))


# --- the reference against bitsandbytes ------------------------------------------------------------------------


def exact_adamw(p, grads, lr, betas, eps, wd):
    """fp64 AdamW with bnb's ordering (decoupled decay before the step): the yardstick for both."""
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p * (1 - lr * wd) - lr / (1 - betas[0] ** t) * m / (v.sqrt() / math.sqrt(1 - betas[1] ** t) + eps)
    return p, m, v


def run_both(n=8192, steps=20, unused_rows=False, seed=0):
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.0 if unused_rows else 0.01
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * 1e-2 for _ in range(steps)]
    if unused_rows:  # like embedding rows of tokens never seen: zero gradient, sharing blocks with used rows
        for grad in grads:
            grad.view(-1, 64)[1::3] = 0.0
    param = torch.nn.Parameter(start.clone())
    plain = bnb.optim.AdamW8bit([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, min_8bit_size=0)
    layout = GroupLayout((n,), 1)
    ours = start.clone()
    codes1, codes2 = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    absmax1, absmax2 = torch.zeros(n // 256), torch.zeros(n // 256)
    table = rules.segment_table(layout.segments(0, [True]), [0])
    for t, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        plain.step()
        reference.adam8bit_step(ours, grad, codes1, codes2, absmax1, absmax2, torch.zeros(0), torch.zeros(0), QMAP1,
                                QMAP2, table, rules.hyper_table([AdamHyper.adamw(lr, *betas, eps, wd, t)]), 1.0)
    exact = exact_adamw(start, grads, lr, betas, eps, wd)
    theirs = (param.detach(), plain.state[param]["state1"], plain.state[param]["absmax1"])
    return (ours, codes1, absmax1), theirs, exact, start


def test_reference_codes_within_one_step_of_bnb():
    (_, codes, absmax), (_, bnb_codes, bnb_absmax), _, _ = run_both(steps=1)
    # same block scale (the first moment of one step), so codes compare directly, as sorted positions
    assert torch.allclose(absmax, bnb_absmax, rtol=1e-6)
    rank = torch.argsort(torch.argsort(QMAP1))
    assert (rank[codes.long()] - rank[bnb_codes.long()]).abs().max() <= 1


def test_reference_error_no_worse_than_bnb():
    (ours, _, _), (theirs, _, _), (exact, _, _), _ = run_both()
    our_error = (ours.double() - exact).abs().max()
    bnb_error = (theirs.double() - exact).abs().max()
    assert our_error <= 1.1 * bnb_error, f"ours {our_error:.3e} vs bnb {bnb_error:.3e}"


def test_zero_gradient_elements_never_move():
    """Elements whose gradient is always zero (an embedding row never used) keep their value, without weight decay."""
    (ours, _, _), (theirs, _, _), _, start = run_both(unused_rows=True)
    unused = torch.zeros(ours.numel(), dtype=torch.bool)
    unused.view(-1, 64)[1::3] = True
    assert torch.equal(ours[unused], start[unused])
    assert not torch.equal(theirs[unused], start[unused]), "control: bnb 0.50's CPU path drifts them"


def _small_second_moment_run(use_kernel: bool, steps: int = 3):
    """Steps of 16 blocks where, in each block, one element's gradient is 1e-5 of the others' (an attention weight
    next to busy ones): per step, the largest |update| / lr, and the state after the last step."""
    lr, n = 1e-3, 4096
    g = torch.Generator().manual_seed(7)
    part = object.__new__(Partition)
    part.params = torch.randn(n, generator=g)
    part.codes1, part.codes2 = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    part.absmax1, part.absmax2, part.state1, part.state2 = torch.zeros(16), torch.zeros(16), torch.zeros(0), \
        torch.zeros(0)
    part.qmaps, part.table = [QMAP1, QMAP2], rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0])
    part.hyper = lambda t: rules.hyper_table([AdamHyper.adamw(lr, 0.9, 0.999, 1e-8, 0.0, t)])
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
    ratios, part = _small_second_moment_run(use_kernel=False)
    small = torch.zeros(4096, dtype=torch.bool)
    small[::256] = True
    assert (QMAP2[part.codes2.long()][small] > 0).all()
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
    assert (QMAP2[unfloored.codes2.long()][small] == 0).all()
    assert max(nearest) > 2 * max(bnb_ratios), (nearest, bnb_ratios)  # measured: 3.9 x lr against 1.02
