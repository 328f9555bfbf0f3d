"""Drives the fused 8-bit operators (AdamW, Lion, SGD with momentum) over one ZeRO partition: its segment table,
hyper rows and step.

The flat state is the one the segment-wise bnb path uses (bnb_adapter.py): `state1`/`state2` codes and
`absmax1`/`absmax2` over the partition, `fp32.state1`/`fp32.state2` for fp32-state parameters, `qmap1`/`qmap2`, and
the partition's `step` — so a checkpoint written by either path loads with the other. Lion and SGD-momentum (bnb's
Optimizer1State "lion" and "momentum") have the first of each only. Fused kernels exist for bnb's "adam" update rule
(Adam, AdamW and their 8-bit, 32-bit and paged variants), its "lion" rule (Lion, Lion8bit, PagedLion, ...) and its
"momentum" rule (SGD, SGD8bit, SGD32bit with momentum > 0; bnb ignores dampening and nesterov, and so do we); other
optimizers (LARS, RMSprop, Adagrad, LAMB, AdEMAMix, ...) keep bnb's own step.
"""

from typing import List, Sequence

import torch

from deepspeed_bnb.ops import adam8bit, lion8bit, momentum8bit
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.optim.bnb_adapter import FP32_PREFIX
from deepspeed_bnb.state_layout import Segment

FUSED_RULES = ("adam", "lion", "momentum")  # bnb update rules (Optimizer8bit.optimizer_name) with a fused kernel
_HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")  # the config keys a hyper row depends on
_ROW_KINDS = {"adam": AdamHyper, "lion": LionHyper, "momentum": MomentumHyper}


def supports(optimizer_name: str) -> bool:
    return optimizer_name in FUSED_RULES


class FusedPartition:
    """The fused step of one param group's partition (segment table built once, hyper rows every step)."""

    def __init__(self, segments: Sequence[Segment], overrides: Sequence[dict], device, use_kernel: bool,
                 rule: str = "adam"):
        if not supports(rule):
            raise ValueError(f"FusedPartition: no fused kernel for bnb's {rule!r} update (only {FUSED_RULES})")
        self.rule = rule
        self.overrides: List[dict] = []  # distinct per-parameter config overrides, one hyper row each
        rows = []
        for override in overrides:
            relevant = {k: override[k] for k in _HYPER_KEYS if k in override}
            if relevant not in self.overrides:
                self.overrides.append(relevant)
            rows.append(self.overrides.index(relevant))
        self.table = adam8bit.segment_table(segments, rows).to(device)
        self.use_kernel = use_kernel
        self.device = device
        self._empty = torch.zeros(0, device=device)
        self._empty_codes = torch.zeros(0, dtype=torch.uint8, device=device)

    def hyper(self, group: dict, step: int) -> torch.Tensor:
        rows = []
        for override in self.overrides:
            config = {**{k: group[k] for k in _HYPER_KEYS}, **override}
            beta1, beta2 = config["betas"][:2]
            if self.rule == "lion":
                rows.append(LionHyper.lion(config["lr"], beta1, beta2, config["weight_decay"]))
            elif self.rule == "momentum":  # betas = (momentum, dampening): bnb never uses the dampening
                rows.append(MomentumHyper.momentum(config["lr"], beta1, config["weight_decay"], step))
            else:
                rows.append(AdamHyper.adamw(config["lr"], beta1, beta2, config["eps"], config["weight_decay"], step))
        return adam8bit.hyper_table(rows, _ROW_KINDS[self.rule]).to(self.device)

    @torch.no_grad()
    def step(self, group: dict, params: torch.Tensor, grads: torch.Tensor, state: dict,
             inv_scale: float = 1.0) -> None:
        step = state["step"] + 1  # bnb counts the step before using it (SGD-momentum's step 1 sets m = g)
        codes1, absmax1 = state.get("state1", self._empty_codes), state.get("absmax1", self._empty)
        state1 = state.get(FP32_PREFIX + "state1", self._empty)
        qmap1 = state.get("qmap1")
        if qmap1 is None:  # no 8-bit parameter in this group: the kernel never reads the maps
            qmap1 = torch.zeros(256, device=self.device)
        if self.table.numel() and self.rule == "lion":
            lion8bit.lion8bit_step_(params, grads, codes1, absmax1, state1, qmap1, self.table, self.hyper(group, step),
                                    inv_scale, None, use_kernel=self.use_kernel)
        elif self.table.numel() and self.rule == "momentum":
            momentum8bit.momentum8bit_step_(params, grads, codes1, absmax1, state1, qmap1, self.table,
                                            self.hyper(group, step), inv_scale, None, use_kernel=self.use_kernel)
        elif self.table.numel():
            codes2, absmax2 = state.get("state2", self._empty_codes), state.get("absmax2", self._empty)
            qmap2 = state.get("qmap2", qmap1)
            adam8bit.adam8bit_step_(params, grads, codes1, codes2, absmax1, absmax2, state1,
                                    state.get(FP32_PREFIX + "state2", self._empty), qmap1, qmap2, self.table,
                                    self.hyper(group, step), inv_scale, None, use_kernel=self.use_kernel)
        state["step"] = step

