"""Which code steps a parameter, the fused kernel or bitsandbytes' own update: the one place that decides.

Two questions, asked in this order, both answered with a `Route` (FUSED, or bnb's own update and why):
1. `kernel_route`, once per optimizer and device, from the user's `FusedKernel` setting: may the fused kernel step
   anything here at all? No when the user said `bnb_fused_kernel: false`, when the optimizer's update has no kernel
   or a subclass overrides it (contract.optimizer_reason), on a device without kernels, when the compiled kernels
   cannot be loaded, or when they fail their first-use check on the device (ops/self_check.py: on a GPU against
   bnb's own CUDA update). `true` turns every such reason but the contract's into an error; a kernel that should run
   and cannot warns once and leaves the step to bnb. On GPUs "auto" is the kernel since the GPU proof showed it bit
   for bit with plain bnb over 20 steps at ZeRO-1/2/3 with every master mode, and faster than bnb's update inside
   the engine (benchmarks/results/gpu/2026-11-28-h200-kernels).
2. `route`, per parameter and at every step (configs change during training): a `Route`, FUSED where the kernel
   computes that parameter's own bnb update (contract.param_reason), else one naming why bnb's `update_step` steps
   it. 32-bit state takes the kernel's fp32 path (contract.fp32_param_reason) where that is bnb's own update (bnb's
   CUDA arithmetic reproduces its 32-bit kernels too, so on a GPU one launch steps the whole partition) or where bnb
   has no update of its own (own_update.py).
partition_step.py asks `route` through `route_decisions`; the ZeRO optimizers of every stage ask `kernel_route`.
"""

import enum
import warnings
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import torch

from deepspeed_bnb.ops import loader, rules, self_check
from deepspeed_bnb.optim import master_weights, own_update
from deepspeed_bnb.optim.fused.contract import KERNEL_DEVICES, fp32_param_reason, optimizer_reason, param_reason


@dataclass(frozen=True)
class Route:
    """Which code steps one parameter."""

    reason: Optional[str] = None  # None: the fused kernel; otherwise why bitsandbytes' own update_step steps it

    @property
    def fused(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        return "the fused kernel" if self.fused else f"bnb's own update ({self.reason})"


FUSED = Route()  # the route of every parameter the kernel steps


def _route(reason: Optional[str]) -> Route:
    return FUSED if reason is None else Route(reason)


class FusedKernel(enum.Enum):
    """zero_optimization.bnb_fused_kernel, parsed (runtime/zero/config.py documents the key)."""

    AUTO = "auto"  # the kernel where it computes bnb's own update and passes its first-use check (CPUs and GPUs)
    ON = "true"  # the same per-parameter contract, but the kernel must run: an error where it cannot
    OFF = "false"  # bnb's own update everywhere

    @classmethod
    def of(cls, value) -> "FusedKernel":
        """The setting of the key's value ("auto", true or false; a FusedKernel passes); a ValueError naming the key."""
        if isinstance(value, cls):
            return value
        if value == "auto" and isinstance(value, str):
            return cls.AUTO
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        raise ValueError(f"zero_optimization.bnb_fused_kernel must be \"auto\", true or false; got {value!r}")


def kernel_route(setting, optimizer, device, master: str = master_weights.FP32) -> Route:
    """FUSED where `route` decides per parameter of the bnb `optimizer` on `device`, else the route of every one of
    them (bnb's own update, and why). `setting`: a FusedKernel (or the key's value); `master`: the master weights'
    mode (optim/master_weights.py)."""
    return _route(_kernel_reason(FusedKernel.of(setting), optimizer, device, master))


def _kernel_reason(setting: FusedKernel, optimizer, device, master: str) -> Optional[str]:
    if setting is FusedKernel.OFF:
        return "zero_optimization.bnb_fused_kernel is false"
    reason = optimizer_reason(optimizer)
    if reason is None and device.type not in KERNEL_DEVICES:
        reason = f"the fused kernels run on {' and '.join(KERNEL_DEVICES)}, not on {device.type}"
    if reason is None and not loader.load():
        reason = f"the compiled kernels could not be built or loaded here ({loader.error()})"
        _fall_back(setting, reason)
    if reason is None:
        problem = self_check.disagreement(optimizer.optimizer_name, device, master)
        if problem:
            reason = (f"the compiled '{optimizer.optimizer_name}' kernel failed its first-use check on {device} "
                      f"with {master} master weights "
                      f"against its pure-torch reference ({problem})")
            _fall_back(setting, reason + "; please report it with your CPU/GPU model and torch/CUDA versions")
    if reason is not None and setting is FusedKernel.ON:
        raise ValueError(f"zero_optimization.bnb_fused_kernel: true, but {reason}. Use \"auto\" (the kernel where it "
                         f"models bnb's update, bnb's own update elsewhere) or false.")
    return reason


@dataclass(frozen=True)
class Cpu32Choice:
    """Who steps a rule's 32-bit-state parameters on a CPU, and why (kernel_arithmetic acts on it, `deepspeed-bnb
    kernels` prints it)."""

    arithmetic: str  # rules.BNB_CPU: the kernel, in bnb's own 32-bit CPU arithmetic; else rules.IEEE (see `why`)
    why: str  # who steps them, and why, in words
    disagreement: Optional[str] = None  # how the kernel's copy of bnb's update differs from bnb's here, if it does


def cpu32_choice(rule: str, master: str = master_weights.FP32, device="cpu") -> Cpu32Choice:
    """The bnb_cpu arithmetic where bnb has a CPU update and the kernel's copy of it agrees with it on this machine
    (the first-use check against bnb itself); else the ieee one: the kernel's own fp32 path where bnb has no CPU
    update (0.49; own_update.py), bnb's own update where the copy differs."""
    missing = own_update.missing(device)
    if missing:
        return Cpu32Choice(rules.IEEE, f"the kernel in the reference's arithmetic (bitsandbytes has no CPU update "
                                       f"here: {missing})")
    problem = self_check.disagreement(rule, device, master, rules.BNB_CPU)
    if problem:
        return Cpu32Choice(rules.IEEE, f"bitsandbytes' own update (the kernel's copy of it differs: {problem})",
                           problem)
    return Cpu32Choice(rules.BNB_CPU, "the kernel, same bits as bitsandbytes' own update")


def kernel_arithmetic(kernel: Route, optimizer, device, master: str = master_weights.FP32) -> str:
    """What the fused kernel computes for `optimizer` on `device` (ops/rules.py): on a GPU bnb's CUDA arithmetic; on a
    CPU cpu32_choice's: bnb_cpu, whose fp32 path is bnb's own 32-bit CPU update (so 32-bit-state parameters step in
    the kernel's launch too), where bnb has a CPU update and the kernel's copy of it agrees with it here (torch's
    fused multiply-add needs FMA hardware, its sqrt is its build's own), with a warning where it does not; else ieee.
    `kernel`: the optimizer-wide route (kernel_route)."""
    device = torch.device(device)
    base = rules.DEVICE_ARITHMETIC.get(device.type, rules.IEEE)
    if not kernel.fused or device.type != "cpu" or optimizer.optimizer_name not in rules.RULES:
        return base
    choice = cpu32_choice(optimizer.optimizer_name, master, device)
    if choice.disagreement:
        warnings.warn(f"deepspeed_bnb: the fused '{optimizer.optimizer_name}' kernel's copy of bitsandbytes' own "
                      f"32-bit CPU update differs from it on this machine ({choice.disagreement}); bnb's own update "
                      f"steps the 32-bit-state parameters (same results, slower). Please report it with your CPU "
                      f"model and torch version.", RuntimeWarning, stacklevel=3)
    return choice.arithmetic


def _fall_back(setting: FusedKernel, reason: str) -> None:
    if setting is not FusedKernel.ON:  # `true` raises instead (_kernel_reason)
        warnings.warn(f"deepspeed_bnb: {reason}. bitsandbytes' own update steps this run instead (same optimizer, "
                      f"bnb's speed); zero_optimization.bnb_fused_kernel: false silences this.", RuntimeWarning,
                      stacklevel=5)


def route(optimizer, kernel: Route, config: dict, eight_bit: bool,
          no_own_update: Optional[str], arithmetic: str = rules.IEEE) -> Route:
    """The route of a parameter of `optimizer` whose bnb config is `config` (8-bit state or not). `kernel`: the
    optimizer-wide answer above (kernel_route); `no_own_update`: why bnb has no update of its own on the partition's
    device (own_update.missing), or None; `arithmetic`: what the kernel computes there (rules.arithmetic_for)."""
    if not kernel.fused:
        return kernel
    whole = optimizer_reason(optimizer)
    if whole:
        return Route(whole)
    reason = param_reason(optimizer.optimizer_name, config, eight_bit)
    if reason is not None and not eight_bit and (no_own_update or arithmetic in (rules.BNB_CUDA, rules.BNB_CPU)):
        # the kernel's fp32 path is bnb's own 32-bit update (bnb_cuda, bnb_cpu), or the only update there is
        return _route(fp32_param_reason(optimizer.optimizer_name, config))
    return _route(reason)


def route_decisions(optimizer, kernel: Route, configs: Sequence[dict], keys: Sequence[tuple],
                    no_own_update: Optional[str] = None, arithmetic: str = rules.IEEE) -> Dict[tuple, Route]:
    """`route` per distinct (config variant among `configs`, precision) pair in `keys`: what a partition re-checks
    every step, as many calls as it has distinct pairs whatever its number of parameters."""
    return {key: route(optimizer, kernel, configs[key[0]], key[1], no_own_update, arithmetic) for key in keys}


def describe_routes(optimizer: str, routes: Mapping[str, Route], shown: int = 8) -> str:
    """One log line: how many parameters the kernel steps, and which ones bnb's own update steps, by reason."""
    by_reason: Dict[Optional[str], list] = {}
    for name, chosen in routes.items():
        by_reason.setdefault(chosen.reason, []).append(name)
    fused = by_reason.pop(None, [])
    parts = [f"deepspeed_bnb: {optimizer}: the fused kernel steps {len(fused)} parameter(s)"]
    for reason, names in by_reason.items():
        more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
        parts.append(f"bnb's own update steps {len(names)} ({', '.join(names[:shown])}{more}): {reason}")
    return "; ".join(parts)
