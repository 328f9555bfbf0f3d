"""When the fused kernel may step a parameter: only where it computes that parameter's own bitsandbytes update.

The fused kernels implement bnb's 8-bit blockwise update of three rules (`optimizer_name` "adam", "lion",
"momentum") with bnb's CUDA numerics (nearest code, 0 representable; ops/reference.py). A parameter is fused only if
1. the optimizer's `update_step` is bnb's own (`Optimizer2State.update_step` for "adam",
   `Optimizer1State.update_step` for "lion" and "momentum"): a subclass that overrides it computes something else;
2. the parameter has 8-bit state: bnb's 32-bit update is its own sequence of torch (or CUDA) operations, which the
   kernel's fp32 path does not reproduce bit for bit, so 32-bit state gets bnb's own update wherever bnb has one
   (`fp32_param_reason`: where it has none, bnb 0.49 on a CPU, the kernel's fp32 path is the only update there is);
3. every field that bnb's `get_config` gives for the parameter (per-parameter overrides and a subclass's own
   `get_config` included) is one in FIELDS or LEGACY_FIELDS, with a value the kernel models (`FieldRule`). An unknown
   field, say one that an override or a subclass adds, is not modelled.
Anything else is stepped by bnb's own `update_step`. Pure functions: no DeepSpeed, no torch.distributed.
"""

import math
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional

import torch

from deepspeed_bnb.ops import rules

# Every key `Optimizer8bit.get_config` returns in bitsandbytes 0.50 (tests/test_fused_contract.py holds this to the
# installed bnb, so a field a new release adds is noticed rather than ignored).
KERNEL_DEVICES = ("cpu", "cuda")  # device types with compiled kernels (csrc/cpu, csrc/cuda)
FIELDS = ("betas", "eps", "weight_decay", "lr", "alpha", "t_alpha", "t_beta3", "optim_bits", "min_8bit_size",
          "max_unorm", "skip_zeros")
# Fields bitsandbytes 0.49 returns besides those (0.50 removed both options): its update_step reads them only at
# values other than their defaults (percentile_clipping < 100 rescales the gradient by a history of its norms,
# block_wise=False quantizes with one scale per tensor), so at the defaults its 8-bit update is 0.50's. bnb_adapter.py
# refuses the other values at initialize, for ZeRO splits the tensor they are computed over.
LEGACY_FIELDS = ("percentile_clipping", "block_wise")


def _real(value) -> Optional[float]:
    """`value` as a float when it is a finite real number (a Python number or a one-element tensor), else None."""
    if isinstance(value, bool):
        return None
    if torch.is_tensor(value):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    if not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _any(value) -> Optional[str]:
    return None


def _finite(value) -> Optional[str]:
    return None if _real(value) is not None else "is not a finite number"


def _non_negative(value) -> Optional[str]:
    real = _real(value)
    return None if real is not None and real >= 0 else "is not a finite number >= 0 (bnb decays only when > 0)"


def _betas(count: int, exact: bool) -> Callable:
    def check(value) -> Optional[str]:
        if not isinstance(value, (tuple, list)) or len(value) < count or (exact and len(value) != count):
            want = f"exactly {count}" if exact else f"at least {count}"
            return f"is not a sequence of {want} betas (bnb reads a third beta where there is one)"
        if any(_real(b) is None or not 0.0 <= _real(b) < 1.0 for b in value[:count]):
            return "has a beta outside [0, 1)"
        return None
    return check


def _equals(default) -> Callable:
    def check(value) -> Optional[str]:
        try:
            same = bool(value == default)
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor of several elements
            same = False
        return None if same else f"is not {default!r}"
    return check


@dataclass(frozen=True)
class FieldRule:
    """How one bnb update rule's kernel treats each get_config field (for 8-bit state)."""

    checks: Dict[str, Callable]  # field -> check(value) giving None (modelled) or why the value is not modelled
    note: str  # what the rule's kernel reads, for error messages and docs


_COMMON = {
    "lr": _finite,
    "weight_decay": _non_negative,
    "optim_bits": _equals(8),  # 32: fp32 state, which is bnb's own update anyway
    "min_8bit_size": _any,  # decides the precision only, which is resolved per parameter before this check
    # bnb's 8-bit update_step never passes max_unorm on (only its 32-bit branch applies a trust ratio)
    "max_unorm": _any,
    "skip_zeros": _equals(False),  # bnb's CUDA kernels skip zero gradients then; the fused kernel does not
    # read by AdEMAMix's own update_step only, never by Optimizer1State/Optimizer2State.update_step
    "t_alpha": _any,
    "t_beta3": _any,
    # LEGACY_FIELDS (bitsandbytes 0.49), at the only values its update_step then ignores
    "percentile_clipping": _equals(100),
    "block_wise": _equals(True),
}

RULES: Dict[str, FieldRule] = {
    # Optimizer2State.update_step hands betas[2] (beta3) and alpha to the 8-bit kernel: modelled only at bnb's
    # neutral values, where bnb's "adam" rule ignores them.
    "adam": FieldRule({**_COMMON, "betas": _betas(2, exact=True), "eps": _non_negative, "alpha": _equals(0.0)},
                      "AdamW with decoupled weight decay: lr, betas (2), eps, weight_decay"),
    # Optimizer1State.update_step hands 0.0 for beta3 and alpha whatever the config says, and bnb's "lion" and
    # "momentum" rules do not read eps.
    "lion": FieldRule({**_COMMON, "betas": _betas(2, exact=False), "eps": _any, "alpha": _any},
                      "Lion with decoupled weight decay: lr, betas[0], betas[1], weight_decay"),
    "momentum": FieldRule({**_COMMON, "betas": _betas(2, exact=False), "eps": _any, "alpha": _any},
                          "SGD with momentum, coupled weight decay: lr, betas[0] (the momentum; bnb ignores the "
                          "dampening in betas[1]), weight_decay"),
}


def base_update_step(rule: str):
    """The bnb `update_step` whose arithmetic the kernel of `rule` reproduces: bnb keeps two moments in an
    Optimizer2State, one in an Optimizer1State."""
    from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State
    return (Optimizer2State if rules.get(rule).moments == 2 else Optimizer1State).update_step


def optimizer_reason(optimizer) -> Optional[str]:
    """Why no parameter of `optimizer` may be fused (its update rule has no kernel, or a subclass overrides
    update_step), or None."""
    rule = optimizer.optimizer_name
    if rule not in RULES:
        return f"bnb's '{rule}' update has no fused kernel (its {', '.join(map(repr, RULES))} updates have one)"
    update_step = type(optimizer).update_step
    if update_step is not base_update_step(rule):
        return (f"{update_step.__module__}.{update_step.__qualname__} overrides bnb's update_step, so the optimizer "
                f"computes its own update")
    return None


def _field_reason(checks: Mapping[str, Callable], config: dict) -> Optional[str]:
    for field in sorted(config):
        check = checks.get(field)
        if check is None:
            return (f"config field {field!r} is not one the fused kernel knows (it models "
                    f"{', '.join(FIELDS + LEGACY_FIELDS)})")
        problem = check(config[field])
        if problem:
            return f"{field}={config[field]!r} {problem}"
    return None


def param_reason(rule: str, config: dict, eight_bit: bool) -> Optional[str]:
    """Why a parameter whose bnb config is `config` must get bnb's own update under `rule`, or None (fused)."""
    if not eight_bit:
        return "32-bit state (bnb's own 32-bit update)"
    return _field_reason(RULES[rule].checks, config)


def fp32_param_reason(rule: str, config: dict) -> Optional[str]:
    """Where bnb has no update of its own (own_update.py): why the kernel's fp32 path cannot step a 32-bit-state
    parameter whose bnb config is `config` under `rule`, or None (it steps it).

    The fp32 path is the kernel's rule without quantization (ops/reference.py), so the 8-bit field checks hold, but
    for two fields that bnb's 32-bit update reads and its 8-bit update does not: `optim_bits` is whatever gave the
    parameter 32-bit state, and `max_unorm` > 0 scales a 32-bit update by a trust ratio the kernel does not compute.
    """
    checks = {**RULES[rule].checks, "optim_bits": _any, "max_unorm": _equals(0.0)}
    return _field_reason(checks, config)


def describe_routes(optimizer: str, routes: Mapping[str, Optional[str]], shown: int = 8) -> str:
    """One log line: how many parameters the kernel steps, and which ones bnb's own update steps, by reason."""
    by_reason: Dict[str, list] = {}
    for name, reason in routes.items():
        by_reason.setdefault(reason, []).append(name)
    fused = by_reason.pop(None, [])
    parts = [f"deepspeed_bnb: {optimizer}: the fused kernel steps {len(fused)} parameter(s)"]
    for reason, names in by_reason.items():
        more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
        parts.append(f"bnb's own update steps {len(names)} ({', '.join(names[:shown])}{more}): {reason}")
    return "; ".join(parts)
