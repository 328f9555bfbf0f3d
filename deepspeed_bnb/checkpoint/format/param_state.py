"""Per-parameter view of partitioned state: every rank's segments of one parameter joined into its ParamState, and a
ParamState cut back into a rank's flat state.

Because every parameter starts on a block boundary and partitions are block-aligned, a parameter's segments join
without requantization (ParamState.concat refuses anything else): the result is byte for byte what plain bitsandbytes
holds for that parameter (flattened: element state as `(rows..., numel)`, block state as `(rows..., blocks)`).
"""

from collections import defaultdict
from typing import List, Mapping, Sequence

from deepspeed_bnb.optim.flat_state import FlatKeys
from deepspeed_bnb.optim.param_state import ParamState
from deepspeed_bnb.state_layout import GroupLayout


def gather_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Mapping,
                        rank_states: Sequence[dict]) -> List[ParamState]:
    """The ParamState of every parameter of a group, from the flat states of all `layout.dp` ranks (in rank order)."""
    if len(rank_states) != layout.dp:
        raise ValueError(f"gather_param_states: {len(rank_states)} rank states for a layout of dp={layout.dp}")
    keys = FlatKeys.of(key_classes)
    pieces = defaultdict(list)  # slot -> its segments' states in rank (= parameter) order
    for rank, state in enumerate(rank_states):
        for seg in layout.segments(rank, eight_bit):
            pieces[seg.slot].append(keys.param_state(state, seg))
    return [ParamState.concat(pieces[slot], what=f"parameter {slot} of the group")
            for slot in range(len(layout.numels))]


def scatter_param_states(layout: GroupLayout, eight_bit: Sequence[bool], key_classes: Mapping,
                         per_param: Sequence[Mapping], rank: int, state: dict) -> None:
    """The inverse of gather_param_states for one rank: write each parameter's state (a ParamState or bnb's state
    dict of it) into `state`, the rank's flat state."""
    keys = FlatKeys.of(key_classes)
    for seg in layout.segments(rank, eight_bit):
        source = per_param[seg.slot]
        if not isinstance(source, ParamState):
            source = ParamState.of(source, keys.bnb_classes(), layout.numels[seg.slot])
        keys.write(state, seg, source.piece(seg.param_start, seg.numel))
