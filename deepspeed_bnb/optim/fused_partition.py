"""Runs a fused 8-bit operator (AdamW, Lion, SGD with momentum) over some segments of one ZeRO partition.

The flat state is the one the segment-wise bnb path uses (bnb_adapter.py): `state1`/`state2` codes and
`absmax1`/`absmax2` over the partition, `fp32.state1`/`fp32.state2` for fp32-state parameters, `qmap1`/`qmap2`, and
the partition's `step`; so a checkpoint written by either path loads with the other, and one partition can mix
both (partition_step.py decides which segment goes where). Lion and SGD-momentum (bnb's Optimizer1State "lion" and
"momentum") have the first of each only. The hyper-parameter rows come from bnb's own per-parameter config
(`get_config` with overrides), so a learning-rate schedule or a per-parameter override reaches the kernel as it
reaches bnb.
"""

from typing import Sequence

import torch

from deepspeed_bnb.ops import adam8bit, lion8bit, momentum8bit
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.optim.bnb_adapter import FP32_PREFIX
from deepspeed_bnb.state_layout import Segment

FUSED_RULES = ("adam", "lion", "momentum")  # bnb update rules (Optimizer8bit.optimizer_name) with a fused kernel
_ROW_KINDS = {"adam": AdamHyper, "lion": LionHyper, "momentum": MomentumHyper}


def hyper_row(rule: str, config: dict, step: int):
    """The hyper row of one bnb config (get_config's fields) at `step` (counted from 1, as bnb counts it)."""
    beta1, beta2 = config["betas"][0], config["betas"][1]
    if rule == "lion":
        return LionHyper.lion(config["lr"], beta1, beta2, config["weight_decay"])
    if rule == "momentum":  # betas = (momentum, dampening): bnb never uses the dampening
        return MomentumHyper.momentum(config["lr"], beta1, config["weight_decay"], step)
    return AdamHyper.adamw(config["lr"], beta1, beta2, config["eps"], config["weight_decay"], step)


class FusedPartition:
    """The fused step of some segments of one partition (segment table built once, hyper rows every step)."""

    def __init__(self, rule: str, segments: Sequence[Segment], rows: Sequence[int], device, use_kernel: bool = True):
        if rule not in FUSED_RULES:
            raise ValueError(f"FusedPartition: no fused kernel for bnb's {rule!r} update (only {FUSED_RULES})")
        self.rule = rule
        self.table = adam8bit.segment_table(segments, rows).to(device)  # rows: index into step()'s configs
        self.use_kernel = use_kernel  # False: the pure-torch reference (tests only)
        self.device = device
        self._empty = torch.zeros(0, device=device)
        self._empty_codes = torch.zeros(0, dtype=torch.uint8, device=device)
        self._no_map = torch.zeros(256, device=device)  # never read: no 8-bit segment

    @torch.no_grad()
    def step(self, configs: Sequence[dict], step: int, params: torch.Tensor, grads: torch.Tensor, state: dict,
             inv_scale: float = 1.0) -> None:
        """Update the segments in place at bnb step `step`, hyper row i from configs[i]; state["step"] is the
        caller's."""
        if not self.table.numel():
            return
        hyper = adam8bit.hyper_table([hyper_row(self.rule, c, step) for c in configs],
                                     _ROW_KINDS[self.rule]).to(self.device)
        codes1, absmax1 = state.get("state1", self._empty_codes), state.get("absmax1", self._empty)
        state1 = state.get(FP32_PREFIX + "state1", self._empty)
        qmap1 = state.get("qmap1", self._no_map)  # a partition without 8-bit parameters has no maps
        if self.rule == "lion":
            lion8bit.lion8bit_step_(params, grads, codes1, absmax1, state1, qmap1, self.table, hyper, inv_scale, None,
                                    use_kernel=self.use_kernel)
        elif self.rule == "momentum":
            momentum8bit.momentum8bit_step_(params, grads, codes1, absmax1, state1, qmap1, self.table, hyper,
                                            inv_scale, None, use_kernel=self.use_kernel)
        else:
            adam8bit.adam8bit_step_(params, grads, codes1, state.get("state2", self._empty_codes), absmax1,
                                    state.get("absmax2", self._empty), state1,
                                    state.get(FP32_PREFIX + "state2", self._empty), qmap1, state.get("qmap2", qmap1),
                                    self.table,
                                    hyper, inv_scale, None, use_kernel=self.use_kernel)


def combined_inv_scale(loss_scale, clip_grad: float, total_norm) -> float:
    """1 / combined_scale exactly as DeepSpeedZeroOptimizer.unscale_and_clip_grads computes it (1.0: no scaling),
    so the kernel can fold the unscale/clip multiply into its single pass (bit-identical to DeepSpeed's grad.mul_)."""
    from deepspeed.runtime.utils import is_invalid_grad_norm
    if clip_grad == 0.0 and loss_scale == 1.0:
        return 1.0
    combined_scale = loss_scale
    if clip_grad > 0.0:
        clip_norm = total_norm
        if is_invalid_grad_norm(clip_norm):
            clip_norm = torch.tensor(float("inf"), dtype=torch.float)
        clip = ((clip_norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * loss_scale
    inverse = 1.0 / combined_scale  # a float32 tensor when clipping, else a Python float that mul_ rounds to fp32
    return float(inverse.item() if torch.is_tensor(inverse) else inverse)
