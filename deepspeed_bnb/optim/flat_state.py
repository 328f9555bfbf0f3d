"""A rank's flat partition state as a type: which keys it holds, where each parameter piece's state lies in them, and
that piece's ParamState; the flat counterpart of param_state.ParamState, so the code that cuts, joins, saves and loads
flat state does not switch on the state class itself.

A ZeRO partition keeps the state of all its parameter pieces in one flat dict, which is what DeepSpeed's
`optimizer.state[partition]` and its checkpoints hold. 8-bit pieces keep bnb's keys over the partition's element space
(codes, one absmax per block, the maps once), fp32 pieces their moments under `FP32_PREFIX + name` over a compact space
of their own (no block padding), and the step is one number for the partition. `FlatKeys` is the key -> class
mapping of such a dict plus everything that follows from it: a piece's views, writing a piece back, zero storage, what
a rank saves, loading a saved one, its whole and its partitioned keys, and the cuts and joins of ZeRO-3 sub-groups.
"""

from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from deepspeed_bnb.optim.param_state import ParamState
from deepspeed_bnb.optim.state_classes import FP32_PREFIX, StateClass, zeros_like_partitioned
from deepspeed_bnb.state_layout import BLOCK_SIZE, Segment


def bnb_name(stored: str) -> str:
    """bnb's own name of a flat-state key (fp32 pieces' keys carry FP32_PREFIX)."""
    return stored[len(FP32_PREFIX):] if stored.startswith(FP32_PREFIX) else stored


def stored_name(name: str, cls: StateClass, eight_bit: bool) -> str:
    """The flat-state key of bnb's key `name` for pieces of that precision (the inverse of bnb_name): fp32 pieces'
    partitioned keys get FP32_PREFIX, as they count the compact fp32 space; the step is shared."""
    return name if eight_bit or cls == StateClass.SCALAR else FP32_PREFIX + name


def in_fp32_space(stored: str) -> bool:
    """Whether a flat-state key counts the compact fp32 space (fp32 pieces) rather than the partition's elements."""
    return stored.startswith(FP32_PREFIX)


class FlatKeys(Mapping):
    """The keys of a flat partition state -> their class (scratch keys are never stored, so never here)."""

    def __init__(self, classes: Mapping):
        self._classes: Dict[str, StateClass] = {k: StateClass(v) for k, v in classes.items()}  # stored key -> class

    @classmethod
    def of(cls, classes: Mapping) -> "FlatKeys":
        return classes if isinstance(classes, FlatKeys) else cls(classes)

    def __getitem__(self, key: str) -> StateClass:
        return self._classes[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return f"FlatKeys({ {k: c.value for k, c in self._classes.items()} })"

    # ---- which keys ------------------------------------------------------------------------------------------------

    def bnb_classes(self) -> Dict[str, StateClass]:
        """bnb's own key -> class (a ParamState's classes)."""
        return {bnb_name(k): c for k, c in self._classes.items()}

    def of_precision(self, eight_bit: bool) -> List[str]:
        """The stored keys a piece of that precision reads: its own space's keys and the shared scalars."""
        return [k for k, c in self._classes.items() if c == StateClass.SCALAR or in_fp32_space(k) != eight_bit]

    def held(self, eight_bit: bool) -> set:
        """bnb's keys a parameter of that precision holds."""
        return {bnb_name(k) for k in self.of_precision(eight_bit)}

    def whole(self, state: Mapping) -> dict:
        """The whole keys' values in `state` (the maps: the same on every rank and for every parameter)."""
        return {k: v for k, v in state.items() if k in self._classes and self._classes[k] == StateClass.WHOLE}

    def partitioned(self, state: Mapping) -> dict:
        """The partitioned keys' tensors in `state` (what is cut with the partition: codes, moments, absmax)."""
        return {k: v for k, v in state.items() if k in self._classes and self._classes[k].partitioned}

    # ---- sizes -----------------------------------------------------------------------------------------------------

    @staticmethod
    def _in_space(key: str, elements, fp32):
        """`fp32` for a key of the compact fp32 space, `elements` for one of the partition's elements (a size, an
        offset, or both)."""
        return fp32 if in_fp32_space(key) else elements

    def length(self, key: str, partition_size: int, fp32_numel: int, block: int = BLOCK_SIZE) -> Optional[int]:
        """The last dimension of a partitioned key for a partition of `partition_size` elements whose fp32 pieces
        hold `fp32_numel`; None for a key that does not follow the partition (whole, scalar)."""
        return self._classes[key].length(self._in_space(key, partition_size, fp32_numel), block)

    def zeros(self, templates: Mapping, partition_size: int, fp32_numel: int, device=None) -> dict:
        """Zero flat state for such a partition, shaped like `templates` (bnb's tensors for a probe: rows, dtype);
        whole tensors are the templates' values, scalars copied."""
        state = {}
        for key, cls in self._classes.items():
            value = templates[key]
            if cls.partitioned:
                state[key] = zeros_like_partitioned(cls, value, self._in_space(key, partition_size, fp32_numel),
                                                    device)
            elif torch.is_tensor(value):
                state[key] = value.to(device) if device is not None else value.clone()
            else:
                state[key] = value
        return state

    # ---- one parameter piece ---------------------------------------------------------------------------------------

    def views(self, state: Mapping, seg: Segment) -> dict:
        """bnb's state dict of one segment: views into the flat `state` (its partitioned keys narrowed), by bnb's
        names. Writing into the views writes the partition."""
        views = {}
        for key in self.of_precision(seg.eight_bit):
            cls, value = self._classes[key], state[key]
            if cls.partitioned:
                value = cls.narrow(value, self._in_space(key, seg.offset, seg.fp32_offset), seg.numel)
            views[bnb_name(key)] = value
        return views

    def param_state(self, state: Mapping, seg: Segment) -> ParamState:
        """The ParamState of one segment (views, checked against the segment's size)."""
        return ParamState(self.views(state, seg), self.bnb_classes(), seg.numel)

    def write(self, state: dict, seg: Segment, piece: Mapping) -> None:
        """Write one segment's state (`piece`: its ParamState or bnb's dict of it, `seg.numel` elements) into the flat
        `state`: partitioned keys into the segment's place, scalars set (whole keys are the partition's own)."""
        for key in self.of_precision(seg.eight_bit):
            cls = self._classes[key]
            if cls == StateClass.SCALAR:
                state[key] = piece[key]
            elif cls.partitioned:
                cls.narrow(state[key], self._in_space(key, seg.offset, seg.fp32_offset), seg.numel).copy_(
                    piece[bnb_name(key)])

    # ---- a rank's record -------------------------------------------------------------------------------------------

    def saved_by(self, state: Mapping, dp_rank: int) -> dict:
        """What data-parallel rank `dp_rank` saves of its flat `state`: every key, the whole ones only on rank 0 (they
        are the same everywhere; the loader checks that before it relies on it)."""
        return {k: v for k, v in state.items()
                if k in self._classes and (dp_rank == 0 or self._classes[k] != StateClass.WHOLE)}

    def load(self, live: dict, saved: Mapping, copy_partitioned) -> None:
        """Fill the live flat state from a saved one: scalars set, whole tensors copied, and each partitioned key
        zeroed, then filled by `copy_partitioned(key, cls, tensor)` (the caller knows where its pieces come from)."""
        for key, cls in self._classes.items():
            if cls == StateClass.SCALAR:
                live[key] = saved[key]
            elif cls == StateClass.WHOLE:
                live[key].copy_(saved[key])
            else:
                live[key].zero_()
                copy_partitioned(key, cls, live[key])

    # ---- ZeRO-3 sub-groups -----------------------------------------------------------------------------------------

    def join(self, states: Sequence[Mapping]) -> dict:
        """The flat state of consecutive partitions end to end (ZeRO-3 sub-groups of one param group): partitioned
        keys concatenated, whole keys and scalars the first's. With one state, its own tensors (loaded in place)."""
        if len(states) == 1:
            return {k: v for k, v in states[0].items() if k in self._classes}
        return {k: torch.cat([s[k] for s in states], dim=-1) if self._classes[k].partitioned else states[0][k]
                for k in states[0] if k in self._classes}

    def cut_into(self, live: dict, joined: Mapping, offset: int, size: int, fp32_offset: int, fp32_size: int) -> None:
        """The inverse of join for one partition: its part of `joined` (from `offset` for `size` elements, its fp32
        pieces from `fp32_offset` for `fp32_size`) copied into its flat state `live`."""
        for key, cls in self._classes.items():
            saved = joined[key]
            if cls == StateClass.SCALAR:
                live[key] = saved
            elif saved is live[key]:
                continue  # a param group of one partition is loaded in place
            elif cls.partitioned:
                start, length = self._in_space(key, (offset, size), (fp32_offset, fp32_size))
                live[key].copy_(cls.narrow(saved, start, length))
            else:
                live[key].copy_(saved)
