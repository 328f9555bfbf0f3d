"""One param group's optimizer step on one rank: the fused kernel where it is bnb's own arithmetic, bnb elsewhere.

Which parameters the kernel may step is decided per parameter by fused_contract.py from bnb's own config of that
parameter (get_config with its overrides), and decided again at every step, because configs change during training
(a learning-rate schedule, a hand-edited param group): a parameter whose config leaves what the kernel models is
stepped by bnb's `update_step` from that step on, and back. The two paths share one flat state (bnb_adapter.py), so
a parameter can change path at any step and checkpoints do not care which path wrote them.
"""

from typing import Callable, List, Optional, Sequence

import torch

from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.fused_contract import optimizer_reason, param_reason
from deepspeed_bnb.optim.fused_partition import FusedPartition
from deepspeed_bnb.state_layout import Segment

FUSED = None  # the route of a parameter the kernel steps (any other route is the reason bnb steps it)


def distinct(values: Sequence[dict]):
    """(the distinct values in first-seen order, the index of each value among them); values may be unhashable."""
    unique, index = [], []
    for value in values:
        if value not in unique:
            unique.append(value)
        index.append(unique.index(value))
    return unique, index


def route_table(adapter: BnbAdapter, kernel_reason: Optional[str], configs: Sequence[dict], variant: Sequence[int],
                eight_bit: Sequence[bool]) -> List[Optional[str]]:
    """Per parameter piece (its config variant among `configs`, its precision): FUSED, or why bnb's own update steps
    it. `kernel_reason`: why no parameter may be fused here at all (no kernel on this device, a failed first-use
    check, ...)."""
    memo = {}  # (variant, precision) -> route
    for key in zip(variant, eight_bit):
        if key not in memo:
            memo[key] = (kernel_reason or optimizer_reason(adapter.optimizer)
                         or param_reason(adapter.optimizer_name, configs[key[0]], key[1]))
    return [memo[key] for key in zip(variant, eight_bit)]


def routes(adapter: BnbAdapter, kernel_reason: Optional[str], group: dict, gindex: int, overrides: Sequence[dict],
           eight_bit: Sequence[bool]) -> List[Optional[str]]:
    """Per parameter of a param group (given its overrides and precision): FUSED, or why bnb's own update steps it."""
    variants, index = distinct(overrides)
    return route_table(adapter, kernel_reason, [adapter.config(group, gindex, v) for v in variants], index, eight_bit)


class PartitionStep:
    """The step of one param group's partition on this rank (segments in the rank's flat order)."""

    def __init__(self, adapter: BnbAdapter, gindex: int, segments: Sequence[Segment], overrides: Sequence[dict],
                 device, kernel_reason: Optional[str], on_reroute: Optional[Callable] = None):
        self.adapter = adapter
        self.gindex = gindex
        self.segments = tuple(segments)
        self.variants, self.variant = distinct(overrides)  # distinct per-parameter overrides; each segment's one
        self.device = device
        self.kernel_reason = kernel_reason  # why no parameter may be fused on this rank/device (None: per parameter)
        self.on_reroute = on_reroute  # called with (segments, their old routes, new routes) when routes change
        self.routes: Optional[List[Optional[str]]] = None  # per segment: FUSED or the reason bnb steps it
        self.fused: Optional[FusedPartition] = None  # the kernel over the fused segments (None: there are none)
        self._fused_variants: List[int] = []  # variant of each hyper row of the kernel
        self._configs: List[dict] = []  # bnb's config of each variant, as of the last route()
        self._bnb: List[int] = []  # indices of the segments bnb steps

    def route(self, group: dict) -> None:
        """(Re)decide each segment's path from `group`'s current config; the kernel is rebuilt only on change."""
        self._configs = [self.adapter.config(group, self.gindex, v) for v in self.variants]
        new = route_table(self.adapter, self.kernel_reason, self._configs, self.variant,
                          [s.eight_bit for s in self.segments])
        if new == self.routes:
            return
        old, self.routes = self.routes, new
        fused = [i for i, route in enumerate(new) if route is FUSED]
        self._bnb = [i for i, route in enumerate(new) if route is not FUSED]
        self._fused_variants, rows = distinct([self.variant[i] for i in fused])
        self.fused = (FusedPartition(self.adapter.optimizer_name, [self.segments[i] for i in fused], rows, self.device)
                      if fused else None)
        if old is not None and self.on_reroute is not None:
            self.on_reroute(self.segments, old, new)

    @torch.no_grad()
    def step(self, group: dict, params: torch.Tensor, grads: torch.Tensor, state: dict, inv_scale: float = 1.0):
        """One optimizer step of the partition in place. `inv_scale`: DeepSpeed's unscale/clip factor, not yet
        applied to `grads` (the kernel folds it into its pass; bnb's segments get grads multiplied by it first)."""
        self.route(group)
        step = state["step"] + 1  # bnb counts the step before using it
        if self.fused is not None:
            self.fused.step([self._configs[v] for v in self._fused_variants], step, params, grads, state, inv_scale)
        bnb_segments = [self.segments[i] for i in self._bnb]
        if inv_scale != 1.0:
            for segment in bnb_segments:  # what DeepSpeed's grad.mul_(1 / combined_scale) does, segment by segment
                grads.narrow(0, segment.offset, segment.numel).mul_(inv_scale)
        # also when no segment is bnb's: it advances the partition's step (and the scalars bnb keeps) exactly once
        self.adapter.step(group, self.gindex, params, grads, state, bnb_segments,
                          [self.variants[self.variant[i]] for i in self._bnb])
