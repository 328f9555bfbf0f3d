"""The fused 8-bit AdamW step of one ZeRO partition: the compiled operator when it loads, else the reference.

`segment_table` and `hyper_table` turn the optimizer's segments and param-group settings into the two small tensors
the operators walk (shared with the Lion step, ops/lion8bit.py); `adam8bit_step_` runs it. Both implementations give
bit-identical results (tests/test_fused_step.py).
"""

from typing import Optional, Sequence

import torch

from deepspeed_bnb.ops import loader, reference
from deepspeed_bnb.ops.reference import AdamHyper
from deepspeed_bnb.state_layout import Segment


def segment_table(segments: Sequence[Segment], hyper_rows: Sequence[int]) -> torch.Tensor:
    """int64 [S, 5]: offset, numel, eight_bit, fp32_offset, hyper_row per segment."""
    rows = [(s.offset, s.numel, int(s.eight_bit), max(s.fp32_offset, 0), row) for s, row in zip(segments, hyper_rows)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, reference.SEGMENT_FIELDS)


def hyper_table(rows: Sequence, kind: Optional[type] = None) -> torch.Tensor:
    """float32 [H, kind.FIELDS]: each row (an AdamHyper or a LionHyper) rounded once from fp64. `kind`, the row
    class, defaults to the rows' own (AdamHyper when there are none)."""
    kind = kind or (type(rows[0]) if rows else AdamHyper)
    if any(type(r) is not kind for r in rows):
        raise TypeError(f"hyper_table: every row must be a {kind.__name__}")
    return torch.tensor([r.row() for r in rows], dtype=torch.float64).float().reshape(-1, kind.FIELDS)


def kernel_available() -> bool:
    return loader.load()


def adam8bit_step_(params, grads, codes1, codes2, absmax1, absmax2, state1, state2, qmap1, qmap2, segments, hyper,
                   inv_scale: float = 1.0, lp_params: Optional[torch.Tensor] = None, use_kernel: bool = True) -> None:
    """One fused AdamW step, in place (argument meanings: reference.adam8bit_step)."""
    args = (params, grads, codes1, codes2, absmax1, absmax2, state1, state2, qmap1, qmap2, segments, hyper,
            float(inv_scale), lp_params)
    if use_kernel:
        loader.require().adam8bit_step_(*args)
    else:
        reference.adam8bit_step(*args)
