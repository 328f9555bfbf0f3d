"""Resharding partition state from DP size N to M: a plan of block-aligned copies, and its application (lossless).

Every parameter starts on a block boundary and partitions are block-aligned at any DP, so moving a parameter's state
between layouts is a copy of contiguous runs: codes and fp32 moments element by element, absmax block by block, the
whole tensors (maps) and scalars (step) unchanged. The plan is pure arithmetic on two GroupLayouts; applying it
touches only the old ranks that overlap the new partition.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_bnb.optim.state_classes import StateClass
from deepspeed_bnb.state_layout import GroupLayout, num_blocks


@dataclass(frozen=True)
class Run:
    """A contiguous piece of one parameter that moves from an old rank's partition into the new rank's partition."""

    slot: int  # parameter (flat order)
    src_rank: int  # old rank holding the piece
    src_offset: int  # start in the old rank's partition (element space); block-aligned
    dst_offset: int  # start in the new rank's partition (element space); block-aligned
    src_fp32_offset: int  # start in the old rank's compact fp32 state (-1 for 8-bit parameters)
    dst_fp32_offset: int  # start in the new rank's compact fp32 state (-1 for 8-bit parameters)
    numel: int  # elements; ends on a block boundary or at the parameter's end

    @property
    def blocks(self) -> int:
        return num_blocks(self.numel)


def plan(old: GroupLayout, new: GroupLayout, eight_bit: Sequence[bool], new_rank: int,
         old_slots: Optional[Dict[int, int]] = None, old_eight_bit: Optional[Sequence[bool]] = None
         ) -> Tuple[Run, ...]:
    """The runs that fill `new_rank`'s partition of `new` from the partitions of `old` (same parameters), or, with
    `old_slots` (new slot -> old slot), the parameters of `new` that `old` holds (`old_eight_bit`: their precisions in
    old order): an expert group's experts come from the files of the expert-parallel rank that held them."""
    if old_slots is None:
        if old.numels != new.numels:
            raise ValueError(f"reshard.plan: layouts hold different parameters ({len(old.numels)} vs "
                             f"{len(new.numels)} tensors)")
        old_slots = {slot: slot for slot in range(len(new.numels))}
    elif any(old.numels[o] != new.numels[n] for n, o in old_slots.items()):
        raise ValueError("reshard.plan: a parameter has another number of elements in the old layout")
    # runs are block-aligned when both layouts are (state); fp32 master weights may come from stock ZeRO-3's slices
    old_pieces: Dict[int, list] = {}
    for rank in range(old.dp):
        for seg in old.segments(rank, eight_bit if old_eight_bit is None else old_eight_bit):
            old_pieces.setdefault(seg.slot, []).append((rank, seg))
    runs: List[Run] = []
    for seg in new.segments(new_rank, eight_bit):
        if seg.slot not in old_slots:
            continue
        for rank, src in old_pieces[old_slots[seg.slot]]:
            lo = max(seg.param_start, src.param_start)
            hi = min(seg.param_start + seg.numel, src.param_start + src.numel)
            if lo >= hi:
                continue
            runs.append(Run(
                slot=seg.slot, src_rank=rank,
                src_offset=src.offset + lo - src.param_start, dst_offset=seg.offset + lo - seg.param_start,
                src_fp32_offset=-1 if seg.eight_bit else src.fp32_offset + lo - src.param_start,
                dst_fp32_offset=-1 if seg.eight_bit else seg.fp32_offset + lo - seg.param_start,
                numel=hi - lo))
    return tuple(runs)


def copy_runs(dst: torch.Tensor, fetch: Callable[[int], torch.Tensor], runs: Sequence[Run], cls: StateClass,
              fp32_space: bool = False) -> None:
    """Fill `dst` (one partitioned state tensor of the new rank) from the same tensor of the old ranks.

    `fetch(rank)` returns the old rank's tensor; `fp32_space` selects the compact fp32 offsets (fp32-precision
    parameters' state) instead of partition offsets. Callers pass only the runs of the parameters the key covers.
    """
    for run in runs:
        src = fetch(run.src_rank)
        s, d = (run.src_fp32_offset, run.dst_fp32_offset) if fp32_space else (run.src_offset, run.dst_offset)
        cls.narrow(dst, d, run.numel).copy_(cls.narrow(src, s, run.numel))

