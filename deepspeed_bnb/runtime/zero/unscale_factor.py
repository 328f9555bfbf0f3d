"""DeepSpeed's unscale/clip factor of a step, computed as its unscale_and_clip_grads computes it, for the fused step.

DeepSpeed's step multiplies each gradient partition by `1 / (loss scale * clip)` in a pass of its own, just before
stepping that partition (`unscale_and_clip_grads`, once per param group at ZeRO-1/2 and once per sub-group at ZeRO-3,
with the step's one norm tensor). deepspeed_bnb's ZeRO classes compute that factor here and hand it to the partition's
step, which folds it into the kernel's single pass (optim/fused/partition_step.py): a read and a write of every
gradient saved, and the factor, a 0-dim tensor on the device when it clips, is never read back by the host.
"""

import math
from typing import Optional

import torch

from deepspeed_bnb.runtime.zero import compat


def combined_unscale_factor(zero_optimizer, total_norm, clips_invalid: Optional[bool] = None):
    """What DeepSpeed's unscale_and_clip_grads multiplies a gradient partition by (`1. / combined_scale`), computed
    as the installed release computes it: None where it multiplies by nothing or by exactly 1; else a Python number
    (the loss scale alone) or, with clipping, a tensor on the norm's device. `clips_invalid`: whether the method
    clips an invalid norm (inf, NaN, DeepSpeed's -1) as an infinite one, zeroing the gradient (ZeRO-1/2 from 0.19.8 on,
    compat.py: the default), or clamps whatever the formula gives (earlier releases; ZeRO-3, whose step returns
    before it for an invalid norm). 0.19.7's ZeRO-1/2 returns early without clipping or loss scale and the others
    multiply by 1.0, which changes no value. 0.19.8's check reads the norm back to the host (is_invalid_grad_norm);
    this one selects on the device."""
    loss_scale, clip_grad = zero_optimizer.loss_scale, zero_optimizer.clip_grad
    if clip_grad == 0.0 and loss_scale == 1.0:
        return None
    combined_scale = loss_scale
    if clip_grad > 0.:
        norm = total_norm
        if compat.clips_invalid_norm_as_inf() if clips_invalid is None else clips_invalid:
            if torch.is_tensor(norm):
                norm = torch.where(torch.isfinite(norm) & (norm >= 0), norm,
                                   torch.full_like(norm, float("inf"), dtype=torch.float))
            elif not math.isfinite(float(norm)) or norm < 0:
                norm = torch.tensor(float("inf"), dtype=torch.float)
        # DeepSpeed's formula (its norm is the norm of the scaled gradients)
        clip = ((norm / loss_scale) + 1e-6) / clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * loss_scale
    return 1. / combined_scale


def as_step_scale(factor, device) -> Optional[torch.Tensor]:
    """`factor` as the fused step takes it: None, or a 0-dim float32 tensor on `device` (a number rounded to float32
    once, as DeepSpeed's mul_ of a float32 gradient rounds it)."""
    if factor is None:
        return None
    if torch.is_tensor(factor):
        return factor.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(factor), dtype=torch.float32, device=device)


class StepFactor:
    """The step's factor, computed once per norm tensor: DeepSpeed calls unscale_and_clip_grads once per partition
    with the step's one norm, and the factor is about ten small tensor operations. Keyed by that tensor, its version
    (a norm changed in place) and the scales it used."""

    def __init__(self, clips_invalid: Optional[bool] = None):
        self.clips_invalid = clips_invalid  # see combined_unscale_factor (None: as the release's ZeRO-1/2)
        self._of = (None, None)  # (key of the norm it was computed for, factor)

    def __call__(self, zero_optimizer, total_norm):
        key = (total_norm, total_norm._version, zero_optimizer.loss_scale, zero_optimizer.clip_grad) \
            if torch.is_tensor(total_norm) else None
        cached_key, factor = self._of
        if key is None or cached_key is None or cached_key[0] is not key[0] or cached_key[1:] != key[1:]:
            factor = combined_unscale_factor(zero_optimizer, total_norm, self.clips_invalid)
            self._of = (key, factor)
        return factor
