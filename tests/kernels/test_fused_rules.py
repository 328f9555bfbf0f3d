"""Every fused 8-bit update rule of the registry: compiled kernels bit-identical to the reference, held to bitsandbytes.

Each test runs for every rule of deepspeed_bnb/ops/rules.RULES, on its RuleCase (tests/support/rule_cases.py; a rule
without one fails test_every_rule_has_a_case and each of its tests). Rule-specific semantics:
tests/kernels/test_fused_<rule>.py.
- CPU kernel == reference, bit for bit (params, codes, absmax, fp32 state of every moment; NaN as any NaN), over
  random partitions (8-bit and fp32 segments, tails that are not a multiple of 256, all-zero blocks, huge, tiny,
  NaN and Inf gradients, three hyper rows, an unscale factor; four steps each), with bf16 and fp16 gradients, with
  state already NaN/Inf, with unsorted maps (the portable path the AVX-512 build otherwise skips), and on values on
  and 1..256 ulps next to every midpoint of each map (where a quantizer comparing fewer than 32 bits could go wrong).
  Controls: every tensor a partition's segments use has changed (not two no-ops compared); 255 values sit exactly on
  a midpoint and the value one ulp above gets another code; each of the rule's expressions rounded once (an
  FMA-contracting build) differs from the reference's arithmetic, so the bar can fail.
- the same with the key table instead of the map's runs in the AVX-512 full blocks, its entries gathered or looked up
  by scalar loads (DEEPSPEED_BNB_CPU_KEY_LOOKUP=gather, scalar: settings for comparing them, and for CPUs whose
  gathers are slow); a bad value of that setting is refused by name.
- CUDA: the same comparisons where a GPU is present (ids cpu_kernel / cuda_kernel). (torch.library.opcheck of every
  operator: test_rules.py.)
- reference vs bitsandbytes 0.50 (its CPU path), hyper rows from bnb's own get_config: codes within one step of
  bnb's after one step (control: not all equal: bnb's look-up quantizer ties down); error against an exact fp64 run
  of the rule no worse than 1.1x bnb's own (max and mean; control: small against the update); elements whose gradient
  is always zero never move and their state is stored as exactly 0 (control: the others move, and bnb's CPU path,
  which cannot store 0, moves them).
"""

import inspect

import pytest
import torch

from deepspeed_bnb.ops import compensated, reference, rules
from deepspeed_bnb.ops.self_check import bits
from support.kernel_harness import (QMAP1, UNUSED, Whole, assert_bit_identical, maps, needs_cuda, needs_kernel,
                                    run_both)
from support.rule_cases import CASES

RULES = list(rules.RULES)
SEEDS, NON_FINITE_SEEDS = range(12), range(4)
for_every_rule = pytest.mark.parametrize("rule", RULES)
# the ids name the device's kernel: tests/support/cuda_kernel_run.py selects "-k cuda_kernel" (or cpu_kernel),
# test_build.py "-k 'not cuda'"
on_each_device = pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_kernel, id="cpu_kernel"),
                                                    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda],
                                                                 id="cuda_kernel")])


def test_every_rule_has_a_case():
    assert set(CASES) == set(rules.RULES)
    for name, case in CASES.items():
        assert case.name == name and case.partition(0).RULE == name, name
        assert len(case.squared) == rules.get(name).moments and case.contractions, name


def check_kernel(rule: str, device: str, seed: int, grad_dtype=torch.float32, **variant):
    """Four steps of the rule's random partition by the kernel and by the reference, bit-identical after each; then
    every tensor the partition's segments use has changed."""
    kernel = CASES[rule].partition(seed, device=device, grad_dtype=grad_dtype, **variant)
    start, ref = kernel.clone(), kernel.clone()
    for step in range(1, 5):
        grads = kernel.grads(step)
        inv_scale = 1.0 if step < 3 else 1 / 3.7
        kernel.step(step, grads, True, inv_scale)
        ref.step(step, grads, False, inv_scale)
        assert_bit_identical(kernel, ref, f"{rule}, seed {seed}, step {step}")
    used = {"params"}
    if any(s.eight_bit for s in start.segments):
        used |= {f"{kind}{k}" for kind in ("codes", "absmax") for k in start.moments}
    if not all(s.eight_bit for s in start.segments):
        used |= {f"state{k}" for k in start.moments}
    for name, before, after in zip(start.names, start.tensors(), kernel.tensors()):
        assert name not in used or not torch.equal(bits(before.cpu()), bits(after.cpu())), name


def on_and_near_midpoints(qmap: torch.Tensor, squared: bool) -> torch.Tensor:
    """Values on each midpoint of the map and 1, 2, 100, 255 and 256 ulps either side; their square roots when the
    kernel will see them squared."""
    midpoints, _ = reference.quant_tables(qmap)
    if squared:
        midpoints = midpoints[midpoints > 0].sqrt()
    offsets = torch.tensor([0, 1, -1, 2, -2, 100, -100, 255, -255, 256, -256], dtype=torch.int32)
    return (midpoints.view(torch.int32)[:, None] + offsets[None, :]).flatten().view(torch.float32)


def blocks_led_by_one(values: torch.Tensor) -> torch.Tensor:
    """255 values per 256-element block, each block starting with 1.0 (its absmax: normalizing is exact)."""
    blocks = -(-values.numel() // 255)
    grads = torch.zeros(blocks, 256)
    grads[:, 0] = 1.0
    body = torch.zeros(blocks * 255)
    body[:values.numel()] = values
    grads[:, 1:] = body.view(blocks, 255)
    return grads.flatten()


def first_step_codes(rule: str, grads: torch.Tensor, qmaps, use_kernel: bool, device="cpu") -> list:
    """Every moment's codes after one step from zero state under the case's midpoint_row."""
    part = Whole(rule, torch.zeros(grads.numel(), device=device), lambda t: CASES[rule].midpoint_row, qmaps)
    part.step(1, grads.to(device), use_kernel)
    return [getattr(part, f"codes{k}").cpu() for k in part.moments]


def check_midpoints(rule: str, device: str, shuffled: bool):
    """Values on a midpoint round to the lower entry, values 1..256 ulps away to their side, as in the reference."""
    qmaps = maps(rule, shuffled)
    near = [on_and_near_midpoints(qmap, squared) for qmap, squared in zip(qmaps, CASES[rule].squared)]
    for values in near:  # moment k's values reach its quantizer: the other moments see other values
        grads = blocks_led_by_one(values)
        kernel = first_step_codes(rule, grads, qmaps, True, device)
        ref = first_step_codes(rule, grads, qmaps, False, device)
        assert all(torch.equal(a, b) for a, b in zip(kernel, ref))
    # not vacuous: 255 of the first moments sat exactly on a midpoint, and one ulp above it is another code
    midpoints, _ = reference.quant_tables(qmaps[0])
    assert int(torch.isin(near[0], midpoints).sum()) == 255
    codes = first_step_codes(rule, blocks_led_by_one(near[0]), qmaps, False)[0]
    per_value = codes.view(-1, 256)[:, 1:].flatten()[:near[0].numel()].view(-1, 11)
    assert not torch.equal(per_value[:, 0], per_value[:, 1])


@on_each_device
@pytest.mark.parametrize("seed", SEEDS)
@for_every_rule
def test_kernel_bit_identical_to_reference(rule, seed, device):
    check_kernel(rule, device, seed)


@on_each_device
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@for_every_rule
def test_kernel_low_precision_gradients(rule, grad_dtype, device):
    check_kernel(rule, device, 100, grad_dtype)


@on_each_device
@pytest.mark.parametrize("master", ["bf16", "bf16+8"])
@pytest.mark.parametrize("seed", range(3))
@for_every_rule
def test_kernel_bf16_and_compensated_master_weights(rule, seed, master, device):
    # seed 2 also starts from non-finite state (NaN moments reach the weights)
    check_kernel(rule, device, seed, master=master, **({"corrupt": True} if seed == 2 else {}))


@needs_kernel
@pytest.mark.parametrize("master", ["fp32, bf16 copy", "bf16", "bf16+8"])
@for_every_rule
def test_kernel_bf16_rounding_of_subnormal_and_nan_weights(rule, master):
    """The weights' bf16 rounding (bf16 master weights, compensated ones, the model's bf16 copy) where an x86 conversion
    instruction answers otherwise: subnormal weights (flushed to zero by VCVTNEPS2BF16) and NaN ones (its NaN keeps
    the payload, a negative NaN's sign too; the kernels write 0x7FC0); and signed zeros. Every third weight subnormal,
    every 97th NaN (every other one negative, with a payload), every 89th -0.0, their gradients and the state zero so
    that they stay so; the kernel's bits, NaN payloads included, those of the reference (itself torch's conversion).
    Control: subnormal, NaN and -0.0 weights are still there in full 8-bit blocks after the step."""
    kernel = CASES[rule].partition(7)
    g = torch.Generator().manual_seed(7)
    tiny = torch.randint(1, 1 << 23, kernel.params[::3].shape, generator=g, dtype=torch.int32).view(torch.float32)
    kernel.params[::3] = torch.where(torch.rand(tiny.shape, generator=g) < 0.5, tiny, -tiny)
    kernel.params[1::97] = float("nan")
    kernel.params[1::194] = torch.tensor(-0x3FFFFF, dtype=torch.int32).view(torch.float32)  # 0xFFC00001
    kernel.params[2::89] = -0.0
    for k in kernel.moments:  # zero state (momentum's case starts from random state), so zero gradients stay put
        getattr(kernel, f"absmax{k}").zero_()
        getattr(kernel, f"state{k}").zero_()
    if master == "bf16":
        kernel.params = kernel.params.to(torch.bfloat16)
    elif master == "bf16+8":
        kernel.params, kernel.error = compensated.split(kernel.params)
    ref = kernel.clone()
    copies = [torch.zeros(kernel.params.numel(), dtype=torch.bfloat16) if master == "fp32, bf16 copy" else None
              for _ in range(2)]
    grads = kernel.grads(1)
    grads[::3], grads[1::97], grads[2::89] = 0.0, 0.0, 0.0
    for run, copy, use_kernel in ((kernel, copies[0], True), (ref, copies[1], False)):
        run.step(1, grads, use_kernel, lp_params=copy)
    raw = (lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else bits(t))
    for name, a, b in zip(kernel.names, kernel.tensors(), ref.tensors()):
        assert torch.equal(raw(a), raw(b)), f"{rule}, {master}: {name}"
    if copies[0] is not None:
        assert torch.equal(raw(copies[0]), raw(copies[1])), f"{rule}, {master}: the bf16 copy"
    full = torch.zeros(kernel.params.numel(), dtype=torch.bool)  # in a full 256-element block of an 8-bit segment
    for s in kernel.segments:
        if s.eight_bit:
            full[s.offset:s.offset + s.numel // 256 * 256] = True
    after = kernel.params.float()
    subnormal = (after != 0) & (after.abs() < torch.finfo(torch.float32).tiny)
    negative_zero = (after == 0) & (after.view(torch.int32) < 0)
    assert (full & subnormal).sum() > 100 and (full & after.isnan()).any() and (full & negative_zero).any(), \
        f"{rule}, {master}: vacuous"


@on_each_device
@pytest.mark.parametrize("seed", NON_FINITE_SEEDS)
@for_every_rule
def test_kernel_non_finite_state_and_unsorted_map(rule, seed, device):
    check_kernel(rule, device, 200 + seed, corrupt=True)
    check_kernel(rule, device, 300 + seed, shuffled=True)


@on_each_device
@pytest.mark.parametrize("shuffled", [False, True], ids=["bnb maps", "unsorted maps"])
@for_every_rule
def test_kernel_quantizer_on_and_next_to_midpoints(rule, shuffled, device):
    check_midpoints(rule, device, shuffled)


@on_each_device
@for_every_rule
def test_kernel_blocks_whose_reciprocal_absmax_overflows(rule, device):
    """Moments so small (subnormal) that 1 / absmax overflows to inf: the zero elements' 0 * inf (NaN) is normalized to
    0 and the others' inf kept, bit for bit as the reference does; the kernels skip normalize()'s test only for blocks
    where no such product can arise."""
    qmaps = maps(rule, False)
    grads = torch.zeros(512)
    grads[::3], grads[1::7] = 1e-40, -1e-40  # the second block: 2^-126 too, so its reciprocal is finite (control)
    grads[256] = torch.finfo(torch.float32).tiny
    parts = [Whole(rule, torch.zeros(512, device=device), lambda t: CASES[rule].midpoint_row, qmaps)
             for _ in range(2)]
    for part, use_kernel in zip(parts, (True, False)):
        part.step(1, grads.to(device), use_kernel)
    assert_bit_identical(parts[0], parts[1], f"{rule}, subnormal moments")
    # not vacuous: the first block's reciprocal overflows, its codes hold both outcomes; the second block's does not
    absmax, codes = parts[1].absmax1.cpu(), parts[1].codes1.cpu().view(2, 256)
    assert torch.isinf(1.0 / absmax[0]) and torch.isfinite(1.0 / absmax[1]), absmax
    assert codes[0].unique().numel() >= 2, codes[0].unique()


@needs_kernel
@pytest.mark.parametrize("lookup", ["gather", "scalar"])
@pytest.mark.parametrize("seed", range(4))
@for_every_rule
def test_key_table_lookups_bit_identical_to_reference(rule, seed, lookup, monkeypatch):
    """DEEPSPEED_BNB_CPU_KEY_LOOKUP=gather or scalar (the key table in the AVX-512 full blocks instead of the map's
    runs, its entries gathered or loaded one by one; the AVX2 tails too): the same codes as the reference, also at and
    next to every midpoint. (The default, the runs, is every other test of this file.)"""
    monkeypatch.setenv("DEEPSPEED_BNB_CPU_KEY_LOOKUP", lookup)
    check_kernel(rule, "cpu", seed)
    check_kernel(rule, "cpu", seed, torch.bfloat16)
    if seed == 0:
        check_midpoints(rule, "cpu", False)


@needs_kernel
@pytest.mark.parametrize("value", ["Scalar", "gathered", "run", " "])
def test_a_bad_key_lookup_setting_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv("DEEPSPEED_BNB_CPU_KEY_LOOKUP", value)
    with pytest.raises(RuntimeError, match=r"DEEPSPEED_BNB_CPU_KEY_LOOKUP='.*' must be 'runs' \(the default\), "
                                           r"'gather' or 'scalar'"):
        check_kernel("adam", "cpu", 0)
    monkeypatch.setenv("DEEPSPEED_BNB_CPU_KEY_LOOKUP", "runs")  # control: the default's own name is accepted
    check_kernel("adam", "cpu", 0)


@for_every_rule
def test_control_fma_contraction_is_detected(rule):
    """The bar can fail: each expression of the rule rounded once instead of after every operation changes some
    results."""
    for expression in CASES[rule].contractions:
        operands = [torch.randn(100000) for _ in inspect.signature(expression).parameters]
        separate = expression(*operands)
        fused = expression(*(x.double() for x in operands)).float()
        assert not torch.equal(bits(separate), bits(fused)), inspect.getsource(expression)


# --- the reference against bitsandbytes ------------------------------------------------------------------------


@for_every_rule
def test_reference_codes_within_one_step_of_bnb(rule):
    """The same block scales after one step, so codes compare directly, as sorted positions."""
    ours, (_, bnb_codes, bnb_absmax), _, _ = run_both(CASES[rule], steps=1)
    torch.testing.assert_close(ours.absmax1, bnb_absmax, rtol=CASES[rule].absmax_rtol, atol=0)
    rank = torch.argsort(torch.argsort(QMAP1))
    steps = (rank[ours.codes1.long()] - rank[bnb_codes.long()]).abs()
    assert steps.max() <= 1
    assert steps.any(), "control: bnb's CPU quantizer (a look-up table, ties down) differs from nearest somewhere"


@for_every_rule
def test_reference_error_no_worse_than_bnb(rule):
    ours, (theirs, _, _), exact, start = run_both(CASES[rule])
    our_error, bnb_error = (ours.params.double() - exact).abs(), (theirs.double() - exact).abs()
    assert our_error.max() <= 1.1 * bnb_error.max(), f"max: ours {our_error.max():.3e} vs bnb {bnb_error.max():.3e}"
    assert our_error.mean() <= 1.1 * bnb_error.mean(), f"mean: ours {our_error.mean():.3e} vs {bnb_error.mean():.3e}"
    assert our_error.mean() < 0.1 * (exact - start.double()).abs().mean(), "control: the error is small vs the update"


@for_every_rule
def test_zero_gradient_elements_never_move(rule):
    """Elements whose gradient is always zero (an embedding row never used) keep their value, without weight decay."""
    ours, (theirs, _, _), _, start = run_both(CASES[rule], unused_rows=True)
    unused = torch.zeros(start.numel(), dtype=torch.bool)
    unused.view(-1, 64)[UNUSED] = True
    assert torch.equal(ours.params[unused], start[unused])
    for k, qmap in zip(ours.moments, ours.qmaps):
        assert (qmap[getattr(ours, f"codes{k}")[unused].long()] == 0).all(), f"moment {k} is stored as exactly 0"
    assert not torch.equal(ours.params[~unused], start[~unused]), "the others move"
    assert not torch.equal(theirs[unused], start[unused]), "control: bnb 0.50's CPU path moves them"


@for_every_rule
@pytest.mark.parametrize("master", ["bf16", "bf16+8"])
def test_reference_master_weights_within_one_rounding_of_bnb(rule, master):
    """One step from the same weights: bnb's own update of bf16 parameters (bf16), or of the joined fp32 weights split
    again (bf16+8: what the unfused path steps), against the reference's. The fp32 results differ only by the fp32
    arithmetic (codes within one step above), so the stored weights are equal or one rounding apart: one bf16 ulp,
    or one error step of the compensated weight. Control: the weights moved, by far more than that rounding."""
    case = CASES[rule]
    g = torch.Generator().manual_seed(7)
    start, grad = torch.randn(8192, generator=g), torch.randn(8192, generator=g)  # lr 0.05: steps of many ulps
    hi, lo = compensated.split(start)
    if master == "bf16":
        param = torch.nn.Parameter(hi.clone())
    else:
        param = torch.nn.Parameter(compensated.join(hi, lo))
    plain = case.bnb([param], weight_decay=0.01, min_8bit_size=0)
    plain.param_groups[0]["lr"] = 0.05
    config = plain.get_config(0, 0, plain.param_groups[0])
    param.grad = grad.to(param.dtype)  # bnb takes the gradient in its parameter's dtype: so do we, here
    plain.step()
    ours = Whole(rule, hi.clone(), lambda t: rules.get(rule).row(config, t))
    ours.error = lo.clone() if master == "bf16+8" else None
    ours.step(1, param.grad, False)
    if master == "bf16":
        theirs, mine, unit = param.detach().float(), ours.params.float(), ours.params.float().abs() * 2.0 ** -7
    else:
        mine = compensated.join(ours.params, ours.error)
        theirs = compensated.join(*compensated.split(param.detach()))
        unit = compensated._unit(ours.params)
    apart = (mine - theirs).abs()
    assert (apart <= unit * 1.0001).all(), f"largest difference {apart.max():.3g} in units {(apart / unit).max():.3g}"
    assert (apart == 0).float().mean() > 0.95, f"equal in {(apart == 0).float().mean():.1%} of the elements"
    before = hi.float() if master == "bf16" else compensated.join(hi, lo)
    assert ((mine - before).abs() > 4 * unit).float().mean() > 0.5, "control: most weights moved by several roundings"
