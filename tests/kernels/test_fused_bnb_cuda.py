"""The fused CUDA kernels in bitsandbytes' own arithmetic ("bnb_cuda") equal bnb's CUDA update, bit for bit.

Where a GPU is present (ids cuda_kernel; the GPU proof's kernel part runs them): for every rule of the registry, a
random partition (8-bit and 32-bit segments, block tails, several hyper rows from bnb-style param groups, NaN, Inf,
huge and tiny gradients, an all-zero block, DeepSpeed's unscale factor on some steps) is stepped ten times by the
kernel and by bitsandbytes' own update on the same GPU (ops/bnb_update.py, the oracle), and every tensor (weights,
codes, absmax, fp32 state) agrees bit for bit after every step; with fp32, bf16 and compensated master weights (bf16
gradients with the bf16 ones, as the engine hands them); with segments of 1, 255, 256, 257 and 4097 elements; with a
partition whose first rank owns nothing of a parameter. Control: the ieee arithmetic, which rounds differently, does
not agree with bnb (so the comparison can fail).

Without a GPU these tests skip; tests/kernels/test_bnb_update.py holds the oracle itself to plain bnb optimizers here,
and tests/kernels/test_compact_quantizer.py the kernels' quantizer to bnb's quantize_2D for every float.
"""

import pytest
import torch

from deepspeed_bnb.ops import loader, rules
from support.bnb_cuda_partition import BnbPartition, differences
from support.kernel_harness import BNB_CUDA_CONFIGS as CONFIGS

pytestmark = pytest.mark.gpu  # every test here runs on a CUDA device (skipped without one)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
STEPS = 10
MASTERS = ("fp32", "bf16", "bf16+8")


def check_against_bnb(kernel: BnbPartition, steps: int = STEPS, kernel_arithmetic=rules.BNB_CUDA) -> list:
    """Steps the partition by the kernel and (a copy) by bnb's own update; the first step's differences, or []."""
    theirs = kernel.clone()
    for step in range(1, steps + 1):
        grads = kernel.grads(step)
        inv_scale = None if step % 2 else torch.tensor(1 / 3.7, device=kernel.device)  # DeepSpeed's clip factor
        kernel.step(step, grads, True, inv_scale, kernel_arithmetic)
        theirs.step(step, grads, False, inv_scale)
        found = differences(kernel, theirs)
        if found:
            return [f"step {step}: {d}" for d in found]
    return []


cuda_kernel = pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda, id="cuda_kernel")])
for_every_rule = pytest.mark.parametrize("rule", list(rules.RULES))


@pytest.fixture(autouse=True)
def _kernels():
    if torch.cuda.is_available() and not loader.load():
        pytest.fail(f"the CUDA kernels did not build: {loader.error()}")


@cuda_kernel
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("seed", range(6))
@for_every_rule
def test_kernel_is_bnbs_cuda_update(rule, seed, master, device):
    assert check_against_bnb(BnbPartition(rule, seed, device, master=master, random_start=seed >= 3)) == []


@cuda_kernel
@pytest.mark.parametrize("master", MASTERS)
@for_every_rule
def test_kernel_is_bnbs_cuda_update_at_odd_sizes(rule, master, device):
    numels = (1, 255, 256, 257, 4097, 1, 300)
    eight_bit = [True, True, True, True, True, False, False]
    for rank in range(2):  # rank 0 of 2 also owns pieces that end mid-parameter
        assert check_against_bnb(BnbPartition(rule, 7, device, numels, eight_bit, master, dp=2, rank=rank)) == []


@cuda_kernel
@for_every_rule
def test_control_the_ieee_arithmetic_is_not_bnbs(rule, device):
    """The comparison can fail: the project's IEEE arithmetic (exact sqrt and division, no flush to zero, its own
    tie rule) run with bnb's rows would be another update; here it is run with its own rows and differs from bnb's."""
    partition = BnbPartition(rule, 0, device)
    theirs = partition.clone()
    ieee = rules.get(rule).rows(CONFIGS[rule], 1, rules.IEEE).to(device)
    grads = partition.grads(2)
    rules.step_(rule, partition.params, grads, partition.codes, partition.absmax, partition.state, partition.qmaps,
                partition.table, ieee, None, partition.error, rules.IEEE, use_kernel=True)
    theirs.step(1, grads, False)
    assert differences(partition, theirs)
