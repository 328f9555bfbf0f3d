"""The "bnb_cpu" arithmetic: the CPU kernels step 32-bit-state segments with the bits bitsandbytes' own 32-bit CPU
update gives them, in the same launch as the 8-bit segments (which stay in the ieee arithmetic).

For every rule with a kernel, fp32 / bf16 / compensated master weights and fp32 / bf16 / fp16 gradients: random
partitions (8-bit and fp32 segments of odd sizes, three param groups with and without weight decay, NaN, Inf and
overflowing gradients, an unscale factor) stepped four times by the compiled kernel, by its pure-torch reference
(ops/bnb_cpu32.py) and by bitsandbytes itself (its 32-bit CPU update per fp32 segment, with the param groups' unrounded
values; the reference for the 8-bit segments): all three bit for bit after every step. Controls: the ieee arithmetic's
fp32 segments differ from bnb's (so the comparison can fail), and the fp32 state moved.
"""

import pytest
import torch

from deepspeed_bnb.ops import bnb_update, rules
from deepspeed_bnb.ops.self_check import bits
from support.kernel_harness import assert_bit_identical, needs_kernel
from support.rule_cases import CASES

# three param groups as bnb's get_config gives them: decoupled / coupled weight decay on, off, and strong
CONFIGS = ({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
           {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
           {"lr": 1e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1})
SEEDS = (0, 1, 2, 3, 4, 5)
MASTERS = (None, "bf16", "bf16+8")
GRADS = (torch.float32, torch.bfloat16, torch.float16)


def partitions(rule: str, **variant):
    """The rule's random partitions (tests/support/rule_cases.py) that hold 32-bit-state segments."""
    found = [CASES[rule].partition(seed, **variant) for seed in SEEDS]
    found = [p for p in found if not all(s.eight_bit for s in p.segments)]
    assert found, "no partition with fp32 segments: the test would check nothing"
    return found


def step(part, number: int, grads, inv_scale, how: str):
    """One step of `part` in place: "kernel:<arithmetic>", "reference:<arithmetic>", or "bnb" itself."""
    rule = rules.get(part.RULE)
    kind, arithmetic = how.split(":") if ":" in how else (how, rules.BNB_CPU)
    state = ([getattr(part, f"{name}{k}") for k in part.moments] for name in ("codes", "absmax", "state"))
    args = rules.arguments(rule, part.params, grads, *state, part.qmaps, part.table, rule.rows(CONFIGS, number),
                           inv_scale, part.error, arithmetic)
    run_it = {"kernel": rule.kernel, "reference": lambda: rule.oracle(arithmetic),
              "bnb": lambda: bnb_update.cpu32_oracle(rule, CONFIGS, number)}[kind]()
    run_it(*args)


def gradients(part, steps: int = 4) -> list:
    """The partition's gradients of each step (drawn once: its generator is shared by its clones)."""
    return [part.grads(number) for number in range(1, steps + 1)]


def run(part, grads: list, how: str) -> list:
    """`part` stepped once per gradient (the unscale factor from step 3 on), a copy after each step."""
    part = part.clone()
    out = []
    for number, g in enumerate(grads, 1):
        step(part, number, g, 1.0 if number < 3 else 1 / 3.7, how)
        out.append(part.clone())
    return out


@needs_kernel
@pytest.mark.parametrize("grad_dtype", GRADS, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("master", MASTERS, ids=lambda m: m or "fp32")
@pytest.mark.parametrize("rule", list(rules.RULES))
def test_kernel_reference_and_bnb_agree(rule, master, grad_dtype):
    for part in partitions(rule, master=master, grad_dtype=grad_dtype):
        grads = gradients(part)
        theirs = run(part, grads, "bnb")
        for how in ("kernel:bnb_cpu", "reference:bnb_cpu"):
            for number, (ours, expected) in enumerate(zip(run(part, grads, how), theirs), 1):
                assert_bit_identical(ours, expected, f"{how} vs bnb, {rule}, {master}, {grad_dtype}, step {number}")
        moved = [k for k in part.moments if not torch.equal(bits(theirs[-1].__dict__[f"state{k}"]),
                                                             bits(part.__dict__[f"state{k}"]))]
        assert moved, "the fp32 state never moved"


@needs_kernel
@pytest.mark.parametrize("rule", ["adam", "lion"])
def test_control_ieee_fp32_segments_differ_from_bnb(rule):
    """The ieee arithmetic rounds every operation on its own where bnb's torch operations fuse a multiply-add."""
    part = partitions(rule)[0]
    grads = gradients(part, steps=2)
    ieee, theirs = run(part, grads, "kernel:ieee"), run(part, grads, "bnb")
    assert any(not torch.equal(bits(getattr(a, f"state{k}")), bits(getattr(b, f"state{k}")))
               for a, b in zip(ieee, theirs) for k in part.moments)


@needs_kernel
def test_unknown_arithmetic_is_refused():
    part = partitions("adam")[0]
    with pytest.raises(RuntimeError, match="'ieee' and 'bnb_cpu'"):
        step(part, 1, part.grads(1), 1.0, "kernel:bnb_cuda")
