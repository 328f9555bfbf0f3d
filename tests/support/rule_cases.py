"""What the shared fused-kernel tests need to know of each update rule: one RuleCase per rule of rules.RULES.

tests/kernels/test_fused_rules.py runs every check it holds for all rules on these cases (and fails when a rule of the
registry has none): a new rule adds its RuleCase here, and its own semantics tests in
tests/kernels/test_fused_<name>.py. The pieces: its random partition (hyper rows, start state), a hyper row under which
its first step quantizes the gradient unchanged, the expressions an FMA-contracting build would change, bitsandbytes'
optimizer of the rule and an exact fp64 update in bnb's ordering (the yardsticks the reference is held to), and the
tolerances against bnb.
"""

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Tuple

import bitsandbytes as bnb
import torch

from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from support.kernel_harness import Partition


@dataclass(frozen=True)
class RuleCase:
    """One rule's pieces for the shared tests."""

    name: str  # its key in rules.RULES
    partition: Callable[..., Partition]  # (seed, device=, grad_dtype=, shuffled=, corrupt=): a random partition
    midpoint_row: object  # a hyper row under which one step from zero state quantizes g, per moment (or g * g)
    squared: Tuple[bool, ...]  # per moment: whether that first step quantizes g * g (Adam's v) rather than g
    contractions: Tuple[Callable, ...]  # expressions of its fp32 arithmetic (operands: fp32 or fp64 tensors)
    bnb: Callable  # (params, **kwargs): bitsandbytes' 8-bit optimizer of the rule, kwargs weight_decay and more
    exact: Callable  # (start, grads, config): the parameters after an exact fp64 run, config: bnb's get_config
    grad_scale: float = 1e-2  # of the gradients in the runs against bnb
    absmax_rtol: float = 0.0  # after one step: how far the reference's block scales may be from bnb's


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # a constant as the kernels hold it (exact in an fp64 expression)


class AdamPartition(Partition):
    RULE = "adam"

    def hyper(self, step: int) -> torch.Tensor:
        rows = [AdamHyper.adamw(1e-3, 0.9, 0.999, 1e-8, 0.01, step), AdamHyper.adamw(3e-2, 0.8, 0.95, 1e-6, 0.0, step),
                AdamHyper.adamw(1e-4, 0.9, 0.99, 1e-8, 0.1, step)]
        return rules.hyper_table(rows).to(self.device)


def adam_partition(seed: int, shuffled=False, corrupt=False, **kwargs) -> AdamPartition:
    """From zero state; non-finite or unsorted state from random state (a partition that has been stepped)."""
    return AdamPartition(seed, shuffled=shuffled, corrupt=corrupt, random_start=shuffled or corrupt, **kwargs)


def exact_adamw(p, grads, config):
    """fp64 AdamW with bnb's ordering (decoupled decay before the step)."""
    lr, (beta1, beta2), eps, wd = config["lr"], config["betas"], config["eps"], config["weight_decay"]
    p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p * (1 - lr * wd) - lr / (1 - beta1 ** t) * m / (v.sqrt() / math.sqrt(1 - beta2 ** t) + eps)
    return p


class LionPartition(Partition):
    RULE = "lion"

    def hyper(self, step: int) -> torch.Tensor:
        rows = [LionHyper.lion(1e-4, 0.9, 0.99, 0.1), LionHyper.lion(3e-3, 0.95, 0.98, 0.0),
                LionHyper.lion(1e-3, 0.5, 0.9, 1.0)]
        return rules.hyper_table(rows).to(self.device)


def exact_lion(p, grads, config):
    """fp64 Lion as bnb orders it (decoupled decay, then the signed step, then the momentum)."""
    lr, (beta1, beta2), wd = config["lr"], config["betas"], config["weight_decay"]
    p, m = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        p = p * (1 - lr * wd) - lr * torch.sign(beta1 * m + (1 - beta1) * g)
        m = beta2 * m + (1 - beta2) * g
    return p


class MomentumPartition(Partition):
    """`later`: past step 1, so that the stored momentum is read (step 1 sets m = g) from the first step on."""

    RULE = "momentum"

    def __init__(self, seed: int, later: bool = False, **kwargs):
        super().__init__(seed, **kwargs)
        self.later = later

    def hyper(self, step: int) -> torch.Tensor:
        step += 1 if self.later else 0
        rows = [MomentumHyper.momentum(1e-2, 0.9, 0.01, step), MomentumHyper.momentum(3e-3, 0.95, 0.0, step),
                MomentumHyper.momentum(1e-1, 0.5, 1e-4, step)]
        return rules.hyper_table(rows).to(self.device)


def momentum_partition(seed: int, shuffled=False, corrupt=False, **kwargs) -> MomentumPartition:
    """From random state; odd seeds start past step 1, and so does non-finite or unsorted state (read only past
    step 1)."""
    return MomentumPartition(seed, later=bool(seed % 2) or shuffled or corrupt, shuffled=shuffled, corrupt=corrupt,
                             random_start=True, **kwargs)


def exact_momentum(p, grads, config):
    """fp64 SGD with momentum as bnb defines it (coupled decay, m = g at step 1; no dampening, no nesterov)."""
    lr, beta1, wd = config["lr"], config["betas"][0], config["weight_decay"]
    p, m = p.double().clone(), None
    for g in grads:
        g = g.double() + wd * p
        m = g if m is None else beta1 * m + g
        p = p - lr * m
    return p


CASES: Dict[str, RuleCase] = {case.name: case for case in (
    RuleCase("adam", adam_partition, midpoint_row=AdamHyper.adamw(1e-3, 0.0, 0.0, 1e-8, 0.0, 1), squared=(False, True),
             contractions=(lambda v, g: _f32(0.999) * v + _f32(0.001) * (g * g),),  # v = beta2 v + (1 - beta2) g g
             bnb=lambda params, **kw: bnb.optim.AdamW8bit(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, **kw),
             exact=exact_adamw, absmax_rtol=1e-6),  # m after one step: (1 - beta1) * g, within 1e-6 of bnb's
    RuleCase("lion", partial(LionPartition, random_start=True),
             midpoint_row=LionHyper.lion(1e-3, 0.9, 0.0, 0.0), squared=(False,),  # beta2 = 0: m = g
             contractions=(lambda m, g: _f32(0.99) * m + _f32(0.01) * g,),  # m = beta2 * m + (1 - beta2) * g
             bnb=lambda params, **kw: bnb.optim.Lion8bit(params, lr=1e-3, betas=(0.9, 0.99), **kw),
             exact=exact_lion),  # absmax exact: m = (1 - beta2) * g, the same fp32 products
    RuleCase("momentum", momentum_partition,
             midpoint_row=MomentumHyper.momentum(1e-3, 0.9, 0.0, 1), squared=(False,),  # step 1, no decay: m = g
             contractions=(lambda m, g: _f32(0.9) * m + g, lambda p, m: p - _f32(0.01) * m),  # beta1 m + g, p - lr m
             bnb=lambda params, **kw: bnb.optim.SGD8bit(params, lr=1e-2, momentum=0.9, **kw),
             exact=exact_momentum, grad_scale=1e-1, absmax_rtol=1e-6),  # m = g + wd * p (bnb may fuse the add)
)}
