"""Per-parameter view of partitioned state: every rank's segments of one parameter joined into its ParamState, and a
ParamState cut back into a rank's flat state.

Because every parameter starts on a block boundary and partitions are block-aligned, a parameter's segments join
without requantization (ParamState.concat refuses anything else): the result is byte for byte what plain bitsandbytes
holds for that parameter (flattened: element state as `(rows..., numel)`, block state as `(rows..., blocks)`).
"""

from collections import defaultdict
from typing import Dict, List, Mapping, Sequence

from deepspeed_bnb.optim.param_state import ParamState
from deepspeed_bnb.optim.state_classes import FP32_PREFIX, StateClass
from deepspeed_bnb.state_layout import GroupLayout, Segment


def _bnb_name(stored_as: str) -> str:
    return stored_as[len(FP32_PREFIX):] if stored_as.startswith(FP32_PREFIX) else stored_as


def bnb_classes(key_classes: Dict[str, StateClass]) -> Dict[str, StateClass]:
    """bnb's own key -> class, from the flat state's stored keys (fp32 segments' keys carry FP32_PREFIX)."""
    return {_bnb_name(key): cls for key, cls in key_classes.items()}


def held_keys(key_classes: Dict[str, StateClass], eight_bit: bool) -> set:
    """bnb's keys a parameter of that precision holds, of the flat state's stored keys."""
    return {_bnb_name(key) for key, cls in key_classes.items()
            if cls == StateClass.SCALAR or key.startswith(FP32_PREFIX) != eight_bit}


def segment_state(state: Mapping, seg: Segment, key_classes: Dict[str, StateClass]) -> ParamState:
    """The ParamState of one segment, read from the rank's flat `state` (its element and block keys narrowed)."""
    values = {}
    for key, cls in key_classes.items():
        if cls == StateClass.SCALAR:
            values[key] = state[key]
        elif key.startswith(FP32_PREFIX) != seg.eight_bit:  # this segment's precision, not the other's
            value = state[key]
            if cls.partitioned:
                value = cls.narrow(value, seg.fp32_offset if key.startswith(FP32_PREFIX) else seg.offset, seg.numel)
            values[_bnb_name(key)] = value
    return ParamState(values, bnb_classes(key_classes), seg.numel)


def gather_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Dict[str, StateClass],
                        rank_states: Sequence[dict]) -> List[ParamState]:
    """The ParamState of every parameter of a group, from the flat states of all `layout.dp` ranks (in rank order)."""
    if len(rank_states) != layout.dp:
        raise ValueError(f"gather_param_states: {len(rank_states)} rank states for a layout of dp={layout.dp}")
    pieces = defaultdict(list)  # slot -> its segments' states in rank (= parameter) order
    for rank, state in enumerate(rank_states):
        for seg in layout.segments(rank, eight_bit):
            pieces[seg.slot].append(segment_state(state, seg, key_classes))
    return [ParamState.concat(pieces[slot], what=f"parameter {slot} of the group") for slot in range(len(layout.numels))]


def scatter_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Dict[str, StateClass],
                         per_param: Sequence[Mapping], rank: int, state: dict) -> None:
    """The inverse of gather_param_states for one rank: write each parameter's state (a ParamState or bnb's state
    dict of it) into `state`, the rank's flat state."""
    classes = bnb_classes(key_classes)
    for seg in layout.segments(rank, eight_bit):
        source = per_param[seg.slot]
        if not isinstance(source, ParamState):
            source = ParamState.of(source, classes, layout.numels[seg.slot])
        piece = source.piece(seg.param_start, seg.numel)
        for key, cls in key_classes.items():
            if cls == StateClass.SCALAR:
                state[key] = piece[key]
            elif key.startswith(FP32_PREFIX) != seg.eight_bit and cls.partitioned:  # whole: the partition's
                start = seg.fp32_offset if key.startswith(FP32_PREFIX) else seg.offset
                cls.narrow(state[key], start, seg.numel).copy_(piece[_bnb_name(key)])
