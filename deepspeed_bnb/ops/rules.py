"""The registry of bitsandbytes update rules with a fused 8-bit kernel, and the one entry point that runs a rule's step.

Each rule (bnb's `optimizer_name`: "adam", "lion", "momentum") is one `UpdateRule` in RULES: how many moments it keeps,
which compiled operator and which pure-torch reference compute it, how its hyper-parameter rows are built from
bnb's own per-parameter config, and which values of that config its kernel models (`fields`, ops/rule_fields.py).
Everything else reads it from here: the loader (which operators a build must register), the shape-only
implementations (ops/fake.py), the first-use check (ops/self_check.py), the fused path of the ZeRO step
(optim/fused/: its contract, routes and partition step), `deepspeed-bnb kernels`, the benchmarks and the tests.
`segment_table` and `hyper_table` pack the two small tensors every operator walks; `step_` runs a rule's step,
compiled or reference.

Every operator has the same argument layout, grouped by kind and numbered by moment (k = 1..moments):
    params, grads, codes<k>..., absmax<k>..., state<k>..., qmap<k>..., segments, hyper, inv_scale, error, arithmetic,
    lp_params
(params: fp32 or bf16 master weights; inv_scale: None, or a one-element float32 tensor on their device holding
DeepSpeed's unscale/clip factor, read by the kernel so that the host never waits for it; error: None, or the int8
error terms of compensated ones; arithmetic: which rounding rules, ARITHMETICS; lp_params: None, or the model's fp32
or bf16 copy of fp32 master weights, written by the kernel: on a GPU bf16 only) (`argument_names`); moment 1 (m)
uses bnb's signed map, moment 2 (v) the unsigned one (SIGNED_MAPS).

Adding a rule touches these files (tests/unit/test_rules.py checks that they agree with each other):
1. deepspeed_bnb/ops/reference.py: its semantics, a `<name>8bit_step` function with the argument layout above, and
   its hyper-row class (a frozen dataclass with FIELDS and row()).
2. deepspeed_bnb/ops/rules.py (here): its UpdateRule in RULES, with the function building its row from get_config
   and the checks of the get_config values its kernel models (from ops/rule_fields.py).
3. csrc/ops.cpp: its operator schema (one m.def).
4. Its kernels: the per-element arithmetic and the row struct in csrc/include/dsbnb/adam8bit.h; csrc/cpu/<op>_cpu.cpp
   (a Rule for fused_cpu.h's one-state walk, or a walk of its own); csrc/cuda/<op>.cu (its Ieee and Bnb rules for
   fused_step.cuh's kernel: the bnb_cuda arithmetic of bnb's own kernels of the rule in
   csrc/include/dsbnb/bnb_cuda_math.h), csrc/cuda/<op>_cuda.cpp, and its launch in csrc/cuda/adam8bit_launch.h.
5. deepspeed_bnb/ops/build_flags.py: its sources.
6. tests: its RuleCase in tests/support/rule_cases.py (partition, hyper rows, exact update, bnb class), which makes
   tests/kernels/test_fused_rules.py hold its kernel to the reference and the reference to bnb; its bnb param groups in
   tests/kernels/test_fused_bnb_cuda.py (CONFIGS: the bnb_cuda kernel against bnb on a GPU); what is its own alone (its
   semantics by hand) in a tests/kernels/test_fused_<name>.py listed in tests/support/kernel_tests.py (portable and GPU
   runs).
The loader, the fake implementations, the first-use check, the ZeRO step, `deepspeed-bnb kernels` and the CUDA build
test need no change: they read this registry or build_flags. Optional: a row in benchmarks/bench_optimizer_step.py
(CONFIGS, IMPLEMENTATIONS) to time it, and its bnb optimizers in tests/kernels/test_matches_bnb.py (HYPER_ROWS).
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from deepspeed_bnb.ops import bnb_update, loader, reference, rule_fields
from deepspeed_bnb.ops.bnb_update import BnbHyper
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.state_layout import Segment

SIGNED_MAPS = (True, False)  # bnb's map of moment 1 (m) is signed, of moment 2 (Adam's v) unsigned
# The rounding rules an operator follows (its `arithmetic` argument):
IEEE = reference.IEEE  # every fp32 operation rounded on its own, the pure-torch reference's (ops/reference.py): CPU
# and CUDA
BNB_CUDA = "bnb_cuda"  # bitsandbytes' own CUDA kernels, operation by operation (csrc/include/dsbnb/bnb_cuda_math.h):
# CUDA only; its oracle is bitsandbytes itself (ops/bnb_update.py); hyper rows are bnb's arguments (BnbHyper)
BNB_CPU = reference.BNB_CPU  # CPU only: 8-bit segments as IEEE, fp32 segments as bitsandbytes' own 32-bit CPU update
# (ops/bnb_cpu32.py, csrc/cpu/bnb_cpu32.h); ieee hyper rows; its oracle is the reference (which computes both)
ARITHMETICS = (IEEE, BNB_CUDA, BNB_CPU)
# what the fused step computes on each device type by default (on a CPU, BNB_CPU where the kernel's copy of bnb's
# 32-bit update agrees with bnb there: optim/fused/route.py, kernel_arithmetic)
DEVICE_ARITHMETIC = {"cpu": IEEE, "cuda": BNB_CUDA}


@dataclass(frozen=True)
class UpdateRule:
    """One bnb update rule with a fused 8-bit kernel."""

    name: str  # bnb's rule name (Optimizer8bit.optimizer_name), the key of RULES
    moments: int  # 2: m (codes1/absmax1/state1, signed qmap1) and v (codes2/..., unsigned qmap2); 1: m only
    operator: str  # the compiled operator, torch.ops.deepspeed_bnb.<operator> (schema: csrc/ops.cpp)
    reference: Callable  # its pure-torch oracle in ops/reference.py, same arguments as the operator
    hyper: type  # its hyper-table row class (reference.AdamHyper, LionHyper, MomentumHyper)
    row: Callable  # row(config, step): the hyper row of one bnb get_config dict at bnb's step (counted from 1)
    fields: Dict[str, Callable] = field(compare=False)  # get_config field -> check(value): None (modelled, 8-bit
    # state) or why not

    def kernel(self) -> Callable:
        """The compiled operator, loaded; a RuntimeError saying why when it cannot be (never the reference)."""
        return getattr(loader.require(), self.operator)

    def row_objects(self, configs: Sequence[dict], step: int, arithmetic: str = IEEE) -> list:
        """The hyper rows (self.hyper, or BnbHyper in bnb's CUDA arithmetic) of bnb get_config dicts `configs` at
        bnb's step `step` (counted from 1)."""
        if arithmetic == BNB_CUDA:
            return [BnbHyper.of(c, step) for c in configs]
        return [self.row(c, step) for c in configs]

    def rows(self, configs: Sequence[dict], step: int, arithmetic: str = IEEE) -> torch.Tensor:
        """The hyper table of bnb get_config dicts `configs` at bnb's step `step` (counted from 1) in `arithmetic`."""
        return hyper_table(self.row_objects(configs, step, arithmetic),
                           BnbHyper if arithmetic == BNB_CUDA else self.hyper)

    def oracle(self, arithmetic: str = IEEE) -> Callable:
        """What the kernel is held to, with the operator's arguments: the pure-torch reference (ieee, bnb_cpu), or
        bitsandbytes' own update (bnb_cuda; on a GPU, bnb's CUDA kernels)."""
        if arithmetic != BNB_CUDA:
            return self.reference
        n = self.moments

        def bnb_own_update(params, grads, *rest):
            segments, hyper, inv_scale, error = rest[4 * n:4 * n + 4]
            if len(rest) > 4 * n + 5 and rest[4 * n + 5] is not None:
                raise ValueError("bnb's own CUDA update writes no model copy (lp_params): leave it None on a GPU")
            bnb_update.step_(self.name, params, grads, rest[:n], rest[n:2 * n], rest[2 * n:3 * n],
                             rest[3 * n:4 * n], segments, hyper, inv_scale, error)
        return bnb_own_update


def _adam_row(config: dict, step: int) -> AdamHyper:
    return AdamHyper.adamw(config["lr"], config["betas"][0], config["betas"][1], config["eps"], config["weight_decay"],
                           step)


def _lion_row(config: dict, step: int) -> LionHyper:
    return LionHyper.lion(config["lr"], config["betas"][0], config["betas"][1], config["weight_decay"])


def _momentum_row(config: dict, step: int) -> MomentumHyper:
    # betas = (momentum, dampening): bnb's rule never uses the dampening
    return MomentumHyper.momentum(config["lr"], config["betas"][0], config["weight_decay"], step)


_ONE_STATE_FIELDS = {
    **rule_fields.COMMON,
    # Optimizer1State.update_step hands 0.0 for beta3 and alpha whatever the config says, and bnb's "lion" and
    # "momentum" rules do not read eps.
    "betas": rule_fields.betas(2, exact=False), "eps": rule_fields.any_value, "alpha": rule_fields.any_value}

RULES: Dict[str, UpdateRule] = {rule.name: rule for rule in (
    UpdateRule("adam", 2, "adam8bit_step_", reference.adam8bit_step, AdamHyper, _adam_row,
               # Optimizer2State.update_step hands betas[2] (beta3) and alpha to the 8-bit kernel: modelled only at
               # bnb's neutral values, where bnb's "adam" rule ignores them.
               {**rule_fields.COMMON, "betas": rule_fields.betas(2, exact=True), "eps": rule_fields.non_negative,
                "alpha": rule_fields.equals(0.0)}),
    # Lion: lr, betas[0], betas[1] and decoupled weight decay
    UpdateRule("lion", 1, "lion8bit_step_", reference.lion8bit_step, LionHyper, _lion_row, _ONE_STATE_FIELDS),
    # SGD with momentum: lr, betas[0] (bnb ignores the dampening in betas[1]) and coupled weight decay
    UpdateRule("momentum", 1, "momentum8bit_step_", reference.momentum8bit_step, MomentumHyper, _momentum_row,
               _ONE_STATE_FIELDS),
)}
OPERATORS = tuple(rule.operator for rule in RULES.values())  # every operator a build must register (equal to
# build_flags.OPERATORS, which the loader checks a build for: tests/unit/test_rules.py)


def get(rule) -> UpdateRule:
    """The UpdateRule of a bnb rule name (an UpdateRule passes through); a ValueError naming the known ones."""
    if isinstance(rule, UpdateRule):
        return rule
    if rule not in RULES:
        raise ValueError(f"no fused kernel for bnb's {rule!r} update rule (the fused rules are {', '.join(RULES)})")
    return RULES[rule]


def arithmetic_for(device) -> str:
    """The arithmetic the fused step computes on `device` (a torch.device or its type name)."""
    kind = torch.device(device).type
    if kind not in DEVICE_ARITHMETIC:
        raise ValueError(f"no fused kernels on {kind} (they run on {', '.join(DEVICE_ARITHMETIC)})")
    return DEVICE_ARITHMETIC[kind]


def segment_table(segments: Sequence[Segment], hyper_rows: Sequence[int]) -> torch.Tensor:
    """int64 [S, 5]: offset, numel, eight_bit, fp32_offset, hyper_row per segment."""
    rows = [(s.offset, s.numel, int(s.eight_bit), max(s.fp32_offset, 0), row) for s, row in zip(segments, hyper_rows)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, reference.SEGMENT_FIELDS)


def hyper_table(rows: Sequence, kind: Optional[type] = None) -> torch.Tensor:
    """float32 [H, kind.FIELDS]: each row (an AdamHyper, LionHyper, MomentumHyper or BnbHyper) rounded once from fp64.
    `kind`, the row class, defaults to the rows' own (AdamHyper when there are none)."""
    kind = kind or (type(rows[0]) if rows else AdamHyper)
    if any(type(r) is not kind for r in rows):
        raise TypeError(f"hyper_table: every row must be a {kind.__name__}")
    # torch rounds each Python float (a double) to float32 once, as .float() of a float64 tensor would: same bits,
    # one tensor fewer on a path that runs every step
    return torch.tensor([r.row() for r in rows], dtype=torch.float32).reshape(-1, kind.FIELDS)


def argument_names(rule) -> Tuple[str, ...]:
    """The operator's (and the reference's) arguments in order, by name."""
    numbers = range(1, get(rule).moments + 1)
    per_moment = [f"{kind}{k}" for kind in ("codes", "absmax", "state", "qmap") for k in numbers]
    return ("params", "grads", *per_moment, "segments", "hyper", "inv_scale", "error", "arithmetic", "lp_params")


def scale_argument(inv_scale, device) -> Optional[torch.Tensor]:
    """The operators' inv_scale argument: None for none (or a number equal to 1), a one-element float32 tensor on
    `device` as a 0-dim view (no copy, so no wait for the device), a number as such a tensor."""
    if inv_scale is None:
        return None
    if torch.is_tensor(inv_scale):
        if inv_scale.dtype != torch.float32 or inv_scale.numel() != 1:
            raise ValueError(f"inv_scale must be a one-element float32 tensor, got {inv_scale.dtype} "
                             f"[{inv_scale.numel()}]")
        return inv_scale.reshape(())
    value = float(inv_scale)
    return None if value == 1.0 else torch.full((), value, dtype=torch.float32, device=device)


def arguments(rule, params: torch.Tensor, grads: torch.Tensor, codes: Sequence[torch.Tensor],
              absmax: Sequence[torch.Tensor], state: Sequence[torch.Tensor], qmaps: Sequence[torch.Tensor],
              segments: torch.Tensor, hyper: torch.Tensor, inv_scale=None, error: Optional[torch.Tensor] = None,
              arithmetic: str = IEEE, lp_params: Optional[torch.Tensor] = None) -> tuple:
    """The operator's positional arguments: codes, absmax, fp32 state and qmaps hold one tensor per moment of the
    rule (moment 1 first); a ValueError when a count differs. `params`: fp32 or bf16 master weights, `error` the int8
    error terms of compensated ones (None otherwise); `inv_scale`: None, a number or a one-element tensor
    (scale_argument); `arithmetic`: one of ARITHMETICS; `lp_params`: None, or the model's copy of the updated weights
    that the kernel writes (fp32 or bf16 on a CPU, bf16 on a GPU, beside fp32 master weights)."""
    rule = get(rule)
    for kind, tensors in (("codes", codes), ("absmax", absmax), ("state", state), ("qmaps", qmaps)):
        if len(tensors) != rule.moments:
            raise ValueError(f"bnb's {rule.name!r} rule keeps {rule.moments} moment(s): {kind} needs "
                             f"{rule.moments} tensor(s), got {len(tensors)}")
    if arithmetic not in ARITHMETICS:
        raise ValueError(f"arithmetic must be one of {', '.join(map(repr, ARITHMETICS))}, got {arithmetic!r}")
    return (params, grads, *codes, *absmax, *state, *qmaps, segments, hyper, scale_argument(inv_scale, params.device),
            error, arithmetic, lp_params)


def step_(rule, params: torch.Tensor, grads: torch.Tensor, codes: Sequence[torch.Tensor],
          absmax: Sequence[torch.Tensor], state: Sequence[torch.Tensor], qmaps: Sequence[torch.Tensor],
          segments: torch.Tensor, hyper: torch.Tensor, inv_scale=None, error: Optional[torch.Tensor] = None,
          arithmetic: str = IEEE, lp_params: Optional[torch.Tensor] = None, *, use_kernel: bool = True) -> None:
    """One fused step of `rule` over a flat partition, in place (arguments: `arguments`; their meaning:
    reference.adam8bit_step). use_kernel: the compiled operator, which raises when it is not loaded (no silent
    fallback); False: its oracle in `arithmetic` (UpdateRule.oracle: tests, benchmarks)."""
    rule = get(rule)
    args = arguments(rule, params, grads, codes, absmax, state, qmaps, segments, hyper, inv_scale, error, arithmetic,
                     lp_params)
    (rule.kernel() if use_kernel else rule.oracle(arithmetic))(*args)
