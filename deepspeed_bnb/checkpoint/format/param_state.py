"""Per-parameter view of partitioned state: every rank's segments of one parameter joined into bnb's own state dict.

Because every parameter starts on a block boundary and partitions are block-aligned, joining a parameter's pieces
is a plain concatenation of codes, absmax and fp32 moments: the result is byte-for-byte what plain bitsandbytes
holds for that parameter (flattened: element state as `(rows..., numel)`, block state as `(rows..., blocks)`).
"""

from collections import defaultdict
from typing import Dict, List, Sequence

import torch

from deepspeed_bnb.optim.state_classes import FP32_PREFIX, StateClass
from deepspeed_bnb.state_layout import GroupLayout


def _bnb_name(stored_as: str) -> str:
    return stored_as[len(FP32_PREFIX):] if stored_as.startswith(FP32_PREFIX) else stored_as


def gather_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Dict[str, StateClass],
                        rank_states: Sequence[dict]) -> List[dict]:
    """bnb-style state of every parameter of a group, from the flat states of all `layout.dp` ranks (in rank order)."""
    if len(rank_states) != layout.dp:
        raise ValueError(f"gather_param_states: {len(rank_states)} rank states for a layout of dp={layout.dp}")
    per_param = [dict() for _ in layout.numels]
    pieces = defaultdict(list)  # (slot, bnb key) -> tensors in parameter order
    for rank, state in enumerate(rank_states):
        for seg in layout.segments(rank, eight_bit):
            for key, cls in key_classes.items():
                fp32_key = key.startswith(FP32_PREFIX)
                if cls == StateClass.SCALAR:
                    per_param[seg.slot][key] = state[key]
                    continue
                if fp32_key == seg.eight_bit:
                    continue  # the other precision's key
                name, value = _bnb_name(key), state[key]
                if cls == StateClass.ELEMENT:
                    start = seg.fp32_offset if fp32_key else seg.offset
                    pieces[(seg.slot, name)].append(value.narrow(-1, start, seg.numel))
                elif cls == StateClass.BLOCK:
                    pieces[(seg.slot, name)].append(value.narrow(-1, seg.first_block, seg.blocks))
                else:
                    per_param[seg.slot][name] = value
    for (slot, name), parts in pieces.items():
        per_param[slot][name] = torch.cat(parts, dim=-1)
    return per_param


def scatter_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Dict[str, StateClass],
                         per_param: Sequence[dict], rank: int, state: dict) -> None:
    """The inverse of gather_param_states for one rank: write each parameter's bnb-style state into `state`."""
    for seg in layout.segments(rank, eight_bit):
        source = per_param[seg.slot]
        for key, cls in key_classes.items():
            fp32_key = key.startswith(FP32_PREFIX)
            if cls == StateClass.SCALAR:
                state[key] = source[key]
                continue
            if fp32_key == seg.eight_bit or cls == StateClass.WHOLE:
                continue  # the other precision's key; whole tensors are the partition's own
            value = source[_bnb_name(key)]
            if cls == StateClass.ELEMENT:
                start = seg.fp32_offset if fp32_key else seg.offset
                state[key].narrow(-1, start, seg.numel).copy_(value.narrow(-1, seg.param_start, seg.numel))
            elif cls == StateClass.BLOCK:
                state[key].narrow(-1, seg.first_block, seg.blocks).copy_(
                    value.narrow(-1, seg.param_start // layout.block, seg.blocks))
