"""The model's copy of the updated weights (the operators' lp_params), written by the kernels for every rule: the CPU
kernels' fp32 and bf16 copies, and where a GPU is present the CUDA kernels' bf16 one (ids cuda_kernel: the GPU proof's
kernel part runs them; their harness runs on the CPU kernels here, ids cpu_kernel).

Oracle: torch's own fp32 -> bf16 (or fp32) copy of the updated master weights, which is what DeepSpeed's step writes
after the optimizer; and the pure-torch reference, which writes the same copy. Per rule, over random partitions (8-bit
and fp32 segments, tails, NaN/Inf gradients, an unscale factor, four steps, both arithmetics of the CPU): the kernel's
params and state are bit for bit those of a kernel run without the copy and of the reference run with it; every element
of every segment of the copy is torch's conversion of the updated weight (NaN: a NaN); the alignment padding of the
copy is never written. Controls: the copy of the weights before a step differs from the one after (at some step of
each run: the bar can fail), and a run without lp_params leaves the copy untouched. Bad input is refused naming
lp_params.
"""

import pytest
import torch

from deepspeed_bnb.ops import compensated, rules
from deepspeed_bnb.ops.self_check import bits
from support.bnb_cuda_partition import BnbPartition, differences
from support.kernel_harness import assert_bit_identical, needs_cuda, needs_kernel
from support.rule_cases import CASES

RULES = list(rules.RULES)
SENTINEL = -7.25  # what the copy holds before the first step: still there in the padding after every step


def segment_mask(partition) -> torch.Tensor:
    """True for the partition's elements inside some segment (the rest is alignment padding)."""
    mask = torch.zeros(partition.params.numel(), dtype=torch.bool)
    for s in partition.segments:
        mask[s.offset:s.offset + s.numel] = True
    return mask


def assert_torch_copy(copy: torch.Tensor, params: torch.Tensor, inside: torch.Tensor, context: str) -> None:
    """copy holds torch's conversion of params in every segment element (NaN where params is NaN), SENTINEL in the
    padding."""
    expected = params.to(copy.dtype)
    nan = params.isnan()
    same = bits(copy) == bits(expected)
    bad = inside & ~nan & ~same
    assert not bad.any(), f"{context}: copy differs from torch's conversion at {bad.nonzero().flatten()[:5].tolist()}"
    assert copy[inside & nan].isnan().all(), f"{context}: a NaN weight's copy is not NaN"
    assert (copy[~inside] == SENTINEL).all(), f"{context}: the copy's alignment padding was written"


@needs_kernel
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("arithmetic", [rules.IEEE, rules.BNB_CPU])
@pytest.mark.parametrize("seed", range(4))
def test_kernel_writes_torchs_copy_and_steps_as_without_it(rule, dtype, arithmetic, seed):
    grad_dtype = (torch.float32, torch.bfloat16, torch.float16, torch.float32)[seed]
    kernel = CASES[rule].partition(seed, grad_dtype=grad_dtype)
    plain, ref = kernel.clone(), kernel.clone()
    inside = segment_mask(kernel)
    copy = torch.full((kernel.params.numel(),), SENTINEL, dtype=dtype)
    ref_copy = copy.clone()
    stale_caught = []
    for step in range(1, 5):
        grads = kernel.grads(step)
        inv_scale = 1.0 if step < 3 else 1 / 3.7
        before = kernel.params.clone()
        for run, lp in ((kernel, copy), (plain, None), (ref, ref_copy)):
            state = ([getattr(run, f"{kind}{k}") for k in run.moments] for kind in ("codes", "absmax", "state"))
            rules.step_(rule, run.params, grads, *state, run.qmaps, run.table, run.hyper(step), inv_scale,
                        arithmetic=arithmetic, lp_params=lp, use_kernel=run is not ref)
        context = f"{rule}, {dtype}, {arithmetic}, seed {seed}, step {step}"
        assert_bit_identical(kernel, plain, context + " (kernel without the copy)")
        assert_bit_identical(kernel, ref, context + " (reference)")
        assert torch.equal(bits(copy), bits(ref_copy)), context + " (the reference's copy)"
        assert_torch_copy(copy, kernel.params, inside, context)
        # control: the copy of the weights before the step is not what was written (at some step: a bf16 copy may
        # hide a step whose moves are all below its rounding, and then a stale copy would be right)
        moved = inside & (before != kernel.params) & ~kernel.params.isnan()
        stale_caught.append(bool(moved.any()) and not torch.equal(bits(copy[moved]), bits(before.to(dtype)[moved])))
    assert any(stale_caught), f"{rule}, {dtype}, {arithmetic}, seed {seed}: no step's copy differed from the last"


@needs_kernel
def test_without_lp_params_the_copy_is_untouched():
    """Control: the copy is written only when asked for (a run without it leaves the tensor as it was)."""
    part = CASES["adam"].partition(0)
    copy = torch.full((part.params.numel(),), SENTINEL, dtype=torch.bfloat16)
    part.step(1, part.grads(1), True)
    assert (copy == SENTINEL).all()
    part.step(2, part.grads(2), True, lp_params=copy)
    assert not (copy[segment_mask(part)] == SENTINEL).any()


@needs_kernel
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_bad_lp_params_are_refused_by_name(use_kernel):
    part = CASES["adam"].partition(1)
    grads = part.grads(1)
    n = part.params.numel()
    cases = {"float16": torch.zeros(n, dtype=torch.float16), "size": torch.zeros(n - 1, dtype=torch.bfloat16)}
    if use_kernel:
        cases["overlap"] = part.params  # the master weights themselves
    for what, lp in cases.items():
        with pytest.raises((RuntimeError, ValueError), match="lp_params"):
            part.step(1, grads, use_kernel, lp_params=lp)
    bf16 = CASES["adam"].partition(1, master="bf16")
    with pytest.raises((RuntimeError, ValueError), match="lp_params.*float32 master"):
        bf16.step(1, bf16.grads(1), use_kernel, lp_params=torch.zeros(n, dtype=torch.bfloat16))


# each device's kernels in the arithmetics they compute there: on a GPU bnb's own CUDA one (the ZeRO step's) and the
# reference's; the CPU row runs the same harness on the CPU kernels, so it is exercised where no GPU is
DEVICE_ARITHMETICS = [pytest.param("cpu", rules.IEEE, id="cpu_kernel-ieee"),
                      pytest.param("cuda", rules.BNB_CUDA, marks=needs_cuda, id="cuda_kernel-bnb_cuda"),
                      pytest.param("cuda", rules.IEEE, marks=needs_cuda, id="cuda_kernel-ieee")]


@needs_kernel
@pytest.mark.parametrize("device, arithmetic", DEVICE_ARITHMETICS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", range(3))
def test_bf16_copy_on_each_device(rule, seed, device, arithmetic):
    """The bf16 copy as the ZeRO step asks a device's kernel for it (fp32 master weights; bnb-style partitions: 8-bit
    and 32-bit segments, tails, three hyper rows, NaN/Inf gradients, DeepSpeed's unscale factor on the device): params
    and state bit for bit those of the same kernel without the copy; the copy torch's conversion of the updated
    weights on that device (what DeepSpeed's copy writes), the padding never written. Control: the copy of the weights
    before the step differs from the one written."""
    kernel = BnbPartition(rule, seed, device, random_start=seed == 2)
    plain = kernel.clone()
    inside = segment_mask(kernel).to(device)
    copy = torch.full((kernel.params.numel(),), SENTINEL, dtype=torch.bfloat16, device=device)
    for step in range(1, 5):
        grads = kernel.grads(step)
        inv_scale = None if step % 2 else torch.tensor(1 / 3.7, device=device)
        before = kernel.params.clone()
        kernel.step(step, grads, True, inv_scale, arithmetic, lp_params=copy)
        plain.step(step, grads, True, inv_scale, arithmetic)
        context = f"{rule}, {device}, {arithmetic}, seed {seed}, step {step}"
        assert differences(kernel, plain) == [], context + " (the kernel without the copy)"
        # torch's conversion on the device itself (a NaN's payload aside: NaN is all a weight's copy must be)
        assert_torch_copy(copy, kernel.params, inside, context)
        moved = inside & (before != kernel.params) & ~kernel.params.isnan()
        assert moved.any() and not torch.equal(bits(copy[moved]), bits(before.to(torch.bfloat16)[moved])), context


@pytest.mark.gpu
@needs_cuda
@needs_kernel
def test_cuda_kernels_refuse_bad_lp_params():
    """The CUDA kernels write a bf16 copy beside fp32 master weights on their device; anything else is refused by
    name: an fp32 copy (an fp32 model's copy stays DeepSpeed's on a GPU), the wrong size, a CPU tensor, a copy over the
    master weights' own bytes, bf16 master weights."""
    part = BnbPartition("adam", 0, "cuda")
    grads, n = part.grads(1), part.params.numel()
    cases = {"bfloat16": torch.zeros(n, device="cuda"), "differ in size": torch.zeros(n - 1, dtype=torch.bfloat16,
                                                                                      device="cuda"),
             "CUDA device": torch.zeros(n, dtype=torch.bfloat16), "overlaps": part.params.view(torch.bfloat16)[:n]}
    for message, lp in cases.items():
        with pytest.raises(RuntimeError, match=f"lp_params.*{message}|{message}.*lp_params"):
            part.step(1, grads, True, lp_params=lp)
    bf16 = BnbPartition("adam", 0, "cuda", master="bf16")
    with pytest.raises(RuntimeError, match="lp_params.*float32 master"):
        bf16.step(1, bf16.grads(1), True, lp_params=torch.zeros(n, dtype=torch.bfloat16, device="cuda"))


def test_reference_copy_rounds_as_torch():
    """The reference's bf16 copy is torch's conversion, its NaN 0x7FC0 (the kernels' canonical NaN)."""
    values = torch.tensor([1.0, 1.00390625, 1.01171875, -3e38, 3.4e38, float("inf"), float("nan"), 1e-40])
    rounded = compensated.to_bf16(values).view(torch.int16)
    assert torch.equal(rounded[:6], values.to(torch.bfloat16).view(torch.int16)[:6])
    assert rounded[6].item() == 0x7FC0 and torch.equal(rounded[7:], values[7:].to(torch.bfloat16).view(torch.int16))
