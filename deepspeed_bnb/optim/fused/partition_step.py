"""One param group's optimizer step on one rank: the fused kernel where it is bnb's own arithmetic, bnb elsewhere.

Which parameters the kernel may step is decided by route.py (its only owner) from bnb's own config of each
parameter (get_config with its overrides), and decided again at every step, because configs change during training
(a learning-rate schedule, a hand-edited param group): a parameter whose config leaves what the kernel models is
stepped by bnb's `update_step` from that step on, and back. The routes are those of every parameter of the partition,
so every rank decides (and logs, and refuses) the same whichever parameters it holds segments of. The two paths share
one flat state (bnb_adapter.py), so a parameter can change path at any step and checkpoints do not care which path
wrote them.

Where bitsandbytes has no update of its own (own_update.py: bnb 0.49 on a CPU), the kernel is the only code that can
step a parameter: it also steps 32-bit state there (its fp32 path, where contract.fp32_param_reason allows), and
a parameter it cannot step is refused at the first route, naming it, instead of failing inside bnb.
"""

import warnings
from typing import Callable, List, Optional, Sequence

import torch

from deepspeed_bnb.optim import own_update
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.fused.contract import optimizer_reason, route_key
from deepspeed_bnb.optim.fused.partition import FusedPartition
from deepspeed_bnb.optim.fused.route import Route, kernel_arithmetic, route_decisions
from deepspeed_bnb.optim.grad_mode import without_grad
from deepspeed_bnb.state_layout import Segment


def distinct(values: Sequence[dict]):
    """(the distinct values in first-seen order, the index of each value among them); values may be unhashable."""
    unique, index = [], []
    for value in values:
        if value not in unique:
            unique.append(value)
        index.append(unique.index(value))
    return unique, index


class NoOwnUpdateError(RuntimeError):
    """A parameter needs bitsandbytes' own update where bitsandbytes has none (own_update.py)."""


def no_own_update_error(adapter: BnbAdapter, gindex: int, kernel: Route, no_own_update: str,
                        stuck: Sequence[tuple]) -> NoOwnUpdateError:
    """The error for the parameters of param group `gindex` that need bnb's own update where it has none; `stuck`:
    distinct (override, 8-bit?, route) of those parameters."""
    name = type(adapter.optimizer).__name__
    whole = optimizer_reason(adapter.optimizer)
    if whole:
        problem = (f"it cannot step any of them: {whole}. To step them here, use an optimizer the fused kernel steps: "
                   f"bitsandbytes' Adam/AdamW, Lion or SGD with momentum (8-bit or 32-bit state), without an "
                   f"update_step of its own")
    elif not kernel.fused:
        problem = (f"it does not run here: {kernel.reason}. To step them here, let it run (zero_optimization."
                   f"bnb_fused_kernel \"auto\" or true, and a build that passes its first-use check: `deepspeed-bnb "
                   f"kernels` says why it does not)")
    else:
        lines = []
        for override, eight_bit, reason in stuck:
            names = adapter.names(gindex, override, eight_bit) or ["(unnamed)"]
            shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
            fix = ("8-bit state (min_8bit_size=0 on an 8-bit optimizer; bnb's 8-bit update ignores max_unorm) or a "
                   "config the kernel models" if not eight_bit else "a config the kernel models")
            lines.append(f"{shown} (param group {gindex}, {'8' if eight_bit else '32'}-bit state): {reason}; to step "
                         f"them here, give them {fix}")
        problem = "it cannot step these: " + "; ".join(lines)
    return NoOwnUpdateError(
        f"deepspeed_bnb: {no_own_update}. On this CPU only the fused kernel can step {name}'s parameters, and "
        f"{problem}. Or install bitsandbytes 0.50.2 (its own CPU update steps any bnb optimizer), or keep the "
        f"optimizer step on a GPU (bitsandbytes' CUDA update; no offload_optimizer).")


def _warn_fp32_path(no_own_update: str) -> None:
    warnings.warn(f"deepspeed_bnb: {no_own_update}. The fused kernel steps the parameters with 32-bit state too (its "
                  f"fp32 path: the update rule of its 8-bit path without quantization, deepspeed_bnb/ops/reference.py; "
                  f"bnb 0.50's CPU update and bnb's CUDA kernels compute the same rule and round differently in the "
                  f"last bits).", RuntimeWarning, stacklevel=3)


class PartitionStep:
    """The step of one partition (a param group at stages 1/2, a sub-group at stage 3) on this rank: the partition's
    parameters in flat order, this rank's segments of them (`Segment.slot` indexes the parameters)."""

    def __init__(self, adapter: BnbAdapter, gindex: int, segments: Sequence[Segment], overrides: Sequence[dict],
                 eight_bit: Sequence[bool], device, kernel: Route,
                 on_reroute: Optional[Callable] = None, arithmetic: Optional[str] = None):
        self.adapter = adapter
        self.gindex = gindex
        self.segments = tuple(segments)  # this rank's pieces of the parameters, in its flat order
        self.variants, self.variant = distinct(overrides)  # distinct per-parameter overrides; each parameter's one
        self.eight_bit = tuple(eight_bit)  # per parameter: 8-bit state?
        self.device = device
        self.kernel = kernel  # the optimizer-wide route on this device (FUSED: each parameter's own, route_decisions)
        self.no_own_update = own_update.missing(device)  # why bnb's own update cannot run on `device` (None: it can)
        # what the kernel computes on `device` (route.kernel_arithmetic, for fp32 master weights unless given)
        self.arithmetic = arithmetic or kernel_arithmetic(kernel, adapter.optimizer, device)
        self.on_reroute = on_reroute  # called with (old routes, new routes) per parameter when they change
        self.param_routes: Optional[List[Route]] = None  # per parameter: which code steps it
        # the distinct (variant, precision) pairs of the parameters: what decides their routes
        self._keys = list(dict.fromkeys(zip(self.variant, self.eight_bit)))
        self._decided: Optional[dict] = None  # the route of each pair, as of the last route()
        self.fused: Optional[FusedPartition] = None  # the kernel over the fused segments (None: there are none)
        self._fused_variants: List[int] = []  # variant of each hyper row of the kernel
        self._configs: List[dict] = []  # bnb's config of each variant, as of the last route()
        self._route_keys: Optional[list] = None  # contract.route_key of each of those configs
        self._bnb: List[int] = []  # indices of the segments bnb steps

    def route(self, group: dict) -> None:
        """(Re)decide each parameter's path from `group`'s current config; the kernel is rebuilt only on change."""
        self._configs = [self.adapter.config(group, self.gindex, v) for v in self.variants]
        # every step: nothing to decide where no config changed in what the routes depend on (a learning-rate
        # schedule changes only lr's value), else one decision per distinct pair, not per parameter (a partition
        # may hold thousands)
        keys = [route_key(c) for c in self._configs]
        unchanged = self._decided is not None and None not in keys and keys == self._route_keys
        self._route_keys = keys
        if unchanged:
            return
        decided = route_decisions(self.adapter.optimizer, self.kernel, self._configs, self._keys, self.no_own_update,
                                  self.arithmetic)
        if decided == self._decided:
            return
        self._decided = decided
        new = [decided[key] for key in zip(self.variant, self.eight_bit)]  # every pair is some parameter's: it changed
        if self.no_own_update:
            stuck, _ = distinct([(self.variants[v], eight_bit, chosen.reason) for v, eight_bit, chosen
                                 in zip(self.variant, self.eight_bit, new) if not chosen.fused])
            if stuck:
                raise no_own_update_error(self.adapter, self.gindex, self.kernel, self.no_own_update, stuck)
            if not all(self.eight_bit):
                _warn_fp32_path(self.no_own_update)
        old, self.param_routes = self.param_routes, new
        fused = [i for i, s in enumerate(self.segments) if new[s.slot].fused]
        self._bnb = [i for i, s in enumerate(self.segments) if not new[s.slot].fused]
        self._fused_variants, rows = distinct([self.variant[self.segments[i].slot] for i in fused])
        self.fused = (FusedPartition(self.adapter.optimizer_name, [self.segments[i] for i in fused], rows, self.device,
                                     arithmetic=self.arithmetic) if fused else None)
        if old is not None and self.on_reroute is not None:
            self.on_reroute(old, new)

    @without_grad
    def step(self, group: dict, params: torch.Tensor, grads: torch.Tensor, state: dict,
             inv_scale: Optional[torch.Tensor] = None, master_error: Optional[torch.Tensor] = None,
             lp_params: Optional[torch.Tensor] = None) -> bool:
        """One optimizer step of the partition in place. `inv_scale`: None, or DeepSpeed's unscale/clip factor as a
        0-dim float32 tensor on the partition's device, not yet applied to `grads` (the kernel reads it in its pass,
        so the host never waits for its value; bnb's segments get grads multiplied by it first).
        `master_error`: the int8 error term of compensated bf16 master weights `params` (None: plain fp32 or bf16).
        `lp_params`: None, or the model's copy of fp32 master weights (runtime/zero/lp_copy.py): where the kernel
        steps any segment, it writes their copy and bnb's segments are copied after bnb's update, and the step
        returns True; else it leaves lp_params alone and returns False (the caller copies as DeepSpeed does)."""
        self.route(group)
        step = state["step"] + 1  # bnb counts the step before using it
        copied = lp_params is not None and self.fused is not None
        if self.fused is not None:
            self.fused.step([self._configs[v] for v in self._fused_variants], step, params, grads, state, inv_scale,
                            master_error, lp_params=lp_params)
        bnb_segments = [self.segments[i] for i in self._bnb]
        # also when no segment is bnb's: it advances the partition's step (and the scalars bnb keeps) exactly once;
        # bnb's segments get what DeepSpeed's grad.mul_(1 / combined_scale) gives them (inv_scale)
        self.adapter.step(group, self.gindex, params, grads, state, bnb_segments,
                          [self.variants[self.variant[s.slot]] for s in bnb_segments], master_error, inv_scale)
        if copied:  # torch's conversion, as DeepSpeed's copy of the whole partition gives them
            for s in bnb_segments:
                lp_params.narrow(0, s.offset, s.numel).copy_(params.narrow(0, s.offset, s.numel))
        return copied
