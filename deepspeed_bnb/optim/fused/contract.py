"""When the fused kernel may step a parameter: only where it computes that parameter's own bitsandbytes update.

The fused kernels implement bnb's blockwise 8-bit update of three rules (`optimizer_name` "adam", "lion",
"momentum"): on a CPU in the IEEE arithmetic of ops/reference.py (nearest code, 0 representable), on a GPU in bnb's
own CUDA arithmetic (ops/rules.py: BNB_CUDA). A parameter is fused only if
1. the optimizer's `update_step` is bnb's own (`Optimizer2State.update_step` for "adam",
   `Optimizer1State.update_step` for "lion" and "momentum"): a subclass that overrides it computes something else;
2. the parameter has 8-bit state, or its 32-bit state is updated by the kernel's fp32 path as bnb would update it
   (`fp32_param_reason`): on a GPU, where the bnb_cuda arithmetic reproduces bnb's 32-bit CUDA kernels; and where
   bnb has no update of its own (bnb 0.49 on a CPU). On a CPU bnb's 32-bit update is its own sequence of torch
   operations, which the IEEE fp32 path does not reproduce bit for bit, so 32-bit state gets bnb's own update there;
3. every field that bnb's `get_config` gives for the parameter (per-parameter overrides and a subclass's own
   `get_config` included) is one the rule's kernel models, at a value it models (`UpdateRule.fields` in
   ops/rules.py). An unknown field, say one that an override or a subclass adds, is not modelled.
Anything else is stepped by bnb's own `update_step`. Pure functions: no DeepSpeed, no torch.distributed.
"""

import math
from typing import Callable, Mapping, Optional

from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.rule_fields import FIELDS, LEGACY_FIELDS, any_value, equals

KERNEL_DEVICES = ("cpu", "cuda")  # device types with compiled kernels (csrc/cpu, csrc/cuda)
_SCALARS = (int, float, str, type(None))  # config values that cannot change in place (bool is an int)
_FINITE_LR = object()  # route_key's stand-in for every finite float lr


def base_update_step(rule: str):
    """The bnb `update_step` whose arithmetic the kernel of `rule` reproduces: bnb keeps two moments in an
    Optimizer2State, one in an Optimizer1State."""
    from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State
    return (Optimizer2State if rules.get(rule).moments == 2 else Optimizer1State).update_step


def optimizer_reason(optimizer) -> Optional[str]:
    """Why no parameter of `optimizer` may be fused (its update rule has no kernel, or a subclass overrides
    update_step), or None."""
    rule = optimizer.optimizer_name
    if rule not in rules.RULES:
        return f"bnb's '{rule}' update has no fused kernel (its {', '.join(map(repr, rules.RULES))} updates have one)"
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
    return _field_reason(rules.get(rule).fields, config)


def fp32_param_reason(rule: str, config: dict) -> Optional[str]:
    """Where bnb has no update of its own (own_update.py): why the kernel's fp32 path cannot step a 32-bit-state
    parameter whose bnb config is `config` under `rule`, or None (it steps it).

    The fp32 path is the kernel's rule without quantization (ops/reference.py), so the 8-bit field checks hold, but
    for two fields that bnb's 32-bit update reads and its 8-bit update does not: `optim_bits` is whatever gave the
    parameter 32-bit state, and `max_unorm` > 0 scales a 32-bit update by a trust ratio the kernel does not compute.
    """
    checks = {**rules.get(rule).fields, "optim_bits": any_value, "max_unorm": equals(0.0)}
    return _field_reason(checks, config)


def route_key(config: dict) -> Optional[tuple]:
    """What the reasons above read of a bnb `config`, as a value that a later change to the config cannot reach: every
    field as it is (a list as a tuple), but a finite float `lr`, which every rule checks only for being a finite
    number (rule_fields.finite), as one stand-in, so that a learning-rate schedule leaves the key alone. Equal keys,
    equal routes and reasons. None when a value could change in place unseen (say a tensor learning rate that a
    scheduler fills): then the caller decides again."""
    items = []
    for name, value in config.items():
        if name == "lr" and isinstance(value, float) and math.isfinite(value):
            value = _FINITE_LR
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
            if not all(isinstance(v, _SCALARS) for v in value):
                return None
        elif not isinstance(value, _SCALARS):
            return None
        items.append((name, value))
    return tuple(items)
