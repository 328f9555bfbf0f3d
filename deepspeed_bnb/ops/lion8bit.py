"""The fused 8-bit Lion step of one ZeRO partition: the compiled operator when it loads, else the reference.

Same segment table as the AdamW step (ops/adam8bit.segment_table); hyper rows are reference.LionHyper, packed by
ops/adam8bit.hyper_table. One state: the momentum, as uint8 codes + per-block absmax (signed map) for 8-bit segments
or packed fp32 for the others. Both implementations give bit-identical results (tests/test_fused_lion.py).
"""

from typing import Optional

import torch

from deepspeed_bnb.ops import loader, reference


def lion8bit_step_(params, grads, codes1, absmax1, state1, qmap1, segments, hyper, inv_scale: float = 1.0,
                   lp_params: Optional[torch.Tensor] = None, use_kernel: bool = True) -> None:
    """One fused Lion step, in place (argument meanings: reference.lion8bit_step)."""
    args = (params, grads, codes1, absmax1, state1, qmap1, segments, hyper, float(inv_scale), lp_params)
    if use_kernel:
        loader.require().lion8bit_step_(*args)
    else:
        reference.lion8bit_step(*args)
