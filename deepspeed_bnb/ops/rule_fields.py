"""The bitsandbytes `get_config` fields a fused 8-bit kernel models, and the checks of their values.

Each rule of the registry (ops/rules.py) carries a map field -> check(value): None where the kernel computes bnb's
update at that value, else why it does not. The maps are built here from a few small checks so that what differs
between rules (their betas, eps, alpha) reads as the difference it is. Pure functions: no bitsandbytes, no DeepSpeed.
"""

import math
from typing import Callable, Dict, Optional

import torch

# Every key `Optimizer8bit.get_config` returns in bitsandbytes 0.50 (tests/kernels/test_fused_contract.py holds this to
# the installed bnb, so a field a new release adds is noticed rather than ignored).
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


def any_value(value) -> Optional[str]:
    return None


def finite(value) -> Optional[str]:
    return None if _real(value) is not None else "is not a finite number"


def non_negative(value) -> Optional[str]:
    real = _real(value)
    return None if real is not None and real >= 0 else "is not a finite number >= 0 (bnb decays only when > 0)"


def betas(count: int, exact: bool) -> Callable:
    def check(value) -> Optional[str]:
        if not isinstance(value, (tuple, list)) or len(value) < count or (exact and len(value) != count):
            want = f"exactly {count}" if exact else f"at least {count}"
            return f"is not a sequence of {want} betas (bnb reads a third beta where there is one)"
        if any(_real(b) is None or not 0.0 <= _real(b) < 1.0 for b in value[:count]):
            return "has a beta outside [0, 1)"
        return None
    return check


def equals(default) -> Callable:
    def check(value) -> Optional[str]:
        try:
            same = bool(value == default)
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor of several elements
            same = False
        return None if same else f"is not {default!r}"
    return check


# The fields every rule treats alike (for 8-bit state).
COMMON: Dict[str, Callable] = {
    "lr": finite,
    "weight_decay": non_negative,
    "optim_bits": equals(8),  # 32: fp32 state, which is bnb's own update anyway
    "min_8bit_size": any_value,  # decides the precision only, which is resolved per parameter before this check
    # bnb's 8-bit update_step never passes max_unorm on (only its 32-bit branch applies a trust ratio)
    "max_unorm": any_value,
    "skip_zeros": equals(False),  # bnb's CUDA kernels skip zero gradients then; the fused kernel does not
    # read by AdEMAMix's own update_step only, never by Optimizer1State/Optimizer2State.update_step
    "t_alpha": any_value,
    "t_beta3": any_value,
    # LEGACY_FIELDS (bitsandbytes 0.49), at the only values its update_step then ignores
    "percentile_clipping": equals(100),
    "block_wise": equals(True),
}
