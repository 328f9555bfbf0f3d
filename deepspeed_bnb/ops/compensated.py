"""Compensated bf16 master weights ("bf16+8"): a bf16 weight and an int8 rounding error, joined to fp32 and split back.

What: a master weight w is kept as `hi`, w rounded to nearest-even bf16 (so `hi` is exactly the model's bf16 weight
DeepSpeed copies out after each step), and `lo`, the rounding error w - hi in units of 1/256 of hi's bf16 ulp, an
int8: w = hi + lo * 2^(E - 16), where hi = m * 2^E with 0.5 <= |m| < 1 (torch.frexp). That is a 24-bit master weight
(16 significant bits) in 3 bytes: an update is lost only when it is below 2^-17 to 2^-16 of its weight (half a
step), where plain bf16 master weights lose every update below 2^-9 to 2^-8 of it (half an ulp). Each update is
rounded to whole steps, so an update of a few steps is off by up to half a step (13.1 steps move 13: tests/
test_master_weights.py); stochastic rounding would remove that bias at the price of bit-exact reruns.
Why: bf16 master weights drop every update smaller than half a bf16 ulp of the weight, which at a small learning rate
is most of them; fp32 master weights cost 4 bytes per parameter. The same idea as FlashOptim's 24-bit master weights
(bf16 plus 8 bits of error); this is its pure-torch definition, which every path that steps compensated weights uses.
Exactness: `join` is exact in fp32 (hi has 8 significant bits, lo adds 8 more below them); `split` rounds w to
nearest-even bf16 and the error to nearest-even 1/256 ulp, clamped to +-127 steps (an error within half a step of
half an ulp, which would round to the tie at 128 steps, keeps 127: off by at most one step); so split(join(hi, lo))
== (hi, lo) for every pair split produced. Below bf16's normal range the unit stays that of the smallest normals.
Test: tests/unit/test_master_weights.py (the compensation and the engine), tests/kernels/test_fused_rules.py (the
kernels).
"""

import torch

ERROR_BITS = 8  # bits of lo: the error in 1/256 ulp of a bf16 weight
_STEP_SHIFT = 16  # hi = m * 2^E, |m| in [0.5, 1): bf16's ulp is 2^(E - 8), the error's unit 2^(E - 8 - ERROR_BITS)
_MIN_EXPONENT = -125  # below it (bf16 subnormals, and 0) bf16's ulp stays 2^-133: the unit stays 2^-141
_MAX_STEPS = 127  # |lo|: 128 units are half an ulp, a tie that rounds hi to its even neighbour on the way back


def _unit(hi: torch.Tensor) -> torch.Tensor:
    """fp32: the value of one step of lo for each hi (2^(E - 16), E at least _MIN_EXPONENT)."""
    _, exponent = torch.frexp(hi.float())
    exponent = torch.where(hi == 0, _MIN_EXPONENT, exponent.clamp_min(_MIN_EXPONENT))
    return torch.ldexp(torch.ones_like(hi, dtype=torch.float32), exponent - _STEP_SHIFT)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master weights of bf16 `hi` and int8 `lo` (a new tensor)."""
    wide = hi.float()
    return torch.where(lo != 0, wide + lo.float() * _unit(hi), wide)  # -0.0 + 0.0 would lose the sign of a zero


def split(w: torch.Tensor):
    """(hi, lo): fp32 `w` split into new bf16 weights and int8 error terms (split_ into fresh tensors)."""
    hi, lo = torch.empty_like(w, dtype=torch.bfloat16), torch.empty_like(w, dtype=torch.int8)
    split_(w, hi, lo)
    return hi, lo


_QUIET_NAN = torch.tensor(0x7FC0, dtype=torch.int16).view(torch.bfloat16)


def to_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp32 `w` rounded to nearest-even bf16, every NaN the quiet NaN 0x7FC0 (torch's scalar conversion writes that,
    its vectorized one 0xFFFF: the fused kernels, csrc/include/dsbnb/master_weights.h, write 0x7FC0). No test of
    whether any NaN is there: on a GPU that would wait for the device at every piece bnb's update steps."""
    return torch.where(w.isnan(), _QUIET_NAN.to(w.device), w.to(torch.bfloat16))


@torch.no_grad()  # hi may be ZeRO's master partition, a leaf that requires grad
def split_(w: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Store fp32 `w` into bf16 `hi` and int8 `lo` (same shape), in place."""
    rounded = to_bf16(w)
    steps = torch.round((w - rounded.float()) / _unit(rounded))
    steps = torch.where(torch.isfinite(steps), steps, torch.zeros_like(steps))  # inf/nan weights: no error term
    hi.copy_(rounded)
    lo.copy_(steps.clamp_(-_MAX_STEPS, _MAX_STEPS).to(torch.int8))
