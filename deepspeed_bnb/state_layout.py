"""Block-aligned placement of parameters in ZeRO's partitions and the per-rank segments it implies (pure math).

DeepSpeed ZeRO-1/2 flattens each param group into one buffer, pads it to a multiple of `2 * dp` and hands every rank
one equal slice. bitsandbytes quantizes optimizer state in 256-element blocks counted from the start of whatever
tensor it is given, so under stock ZeRO the blocks follow the partition, straddle parameters and move when `dp`
changes. Here every parameter starts on a block boundary and the group is padded to a multiple of `block * dp`:
partitions are block-aligned too, each block belongs to exactly one parameter, and a parameter's quantized state is
the same bytes whatever the DP size (GroupLayout).

ZeRO-3 partitions each parameter on its own, padded to a multiple of `dp`, and a rank's optimizer partition is its
slices of several parameters side by side: rank r owns elements [r * c, (r + 1) * c) with c = ceil(numel / dp), which
starts on a block boundary only by chance. Here a parameter is padded to a multiple of `block * dp` instead, so every
slice is whole blocks (ShardedLayout; with block=1 the same class describes stock ZeRO-3's slices). Both layouts give
the same segment tables, so the step, checkpoints and resharding do not care which stage wrote them. Nothing here
touches torch.distributed; it is unit-tested in one process.
"""

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence, Tuple

BLOCK_SIZE = 256
"""bitsandbytes' blockwise-quantization block for optimizer state (every backend since bnb 0.44)."""
MAX_BLOCK = 1 << 16  # the largest block a layout read from a file may have (ours: BLOCK_SIZE, or 1)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def num_blocks(numel: int, block: int = BLOCK_SIZE) -> int:
    return -(-numel // block)


def uses_8bit_state(numel: int, optim_bits: int, min_8bit_size: int) -> bool:
    """bitsandbytes' own per-tensor rule (`Optimizer{1,2}State.init_state`), applied to the whole model parameter.

    Under stock ZeRO bnb sees only the flat partition, so the rule is applied to the partition size instead and a
    parameter's precision flips when DP changes; we apply it to each model parameter, as plain bnb does.
    """
    return optim_bits == 8 and numel >= min_8bit_size


@dataclass(frozen=True)
class ParamSlot:
    """Where one model parameter lives inside its param group's flat buffer."""

    index: int  # position in the group's flat order (DeepSpeed's round-robin order when that is enabled)
    numel: int  # elements of the parameter
    offset: int  # first element inside the group's flat buffer; always a multiple of the block size
    padding: int  # zeros after the parameter up to the next block boundary (0 for the last slot: the tail is ZeRO's)


@dataclass(frozen=True)
class Segment:
    """One row of the segment table a rank's optimizer step walks: the part of one parameter that the rank owns."""

    slot: int  # index of the ParamSlot (and of the parameter in flat order)
    param_start: int  # first parameter element in this segment, counted in the flattened parameter; block-aligned
    numel: int  # elements in the segment
    offset: int  # first element inside the rank's partition; block-aligned
    eight_bit: bool  # True: uint8 codes + per-block absmax; False: fp32 state
    fp32_offset: int  # first element inside the rank's compact fp32 state (only fp32 segments have one; else -1)

    @property
    def first_block(self) -> int:
        """Index of the segment's first block in the rank's per-block (absmax) state."""
        return self.offset // BLOCK_SIZE

    @property
    def blocks(self) -> int:
        """Blocks the segment spans (the last one may be partial: the parameter's own last block)."""
        return num_blocks(self.numel)


def split_segment(segment: Segment, max_numel: int) -> Tuple[Segment, ...]:
    """`segment` cut into consecutive pieces of at most `max_numel` elements (a multiple of the block size), each
    starting on a block boundary: a block-wise update of the pieces one after the other is the update of the whole."""
    if max_numel <= 0 or max_numel % BLOCK_SIZE:
        raise ValueError(f"split_segment: max_numel={max_numel} must be a positive multiple of {BLOCK_SIZE}")
    if segment.numel <= max_numel:
        return (segment,)
    return tuple(Segment(slot=segment.slot, param_start=segment.param_start + start,
                         numel=min(max_numel, segment.numel - start), offset=segment.offset + start,
                         eight_bit=segment.eight_bit,
                         fp32_offset=segment.fp32_offset + start if segment.fp32_offset >= 0 else -1)
                 for start in range(0, segment.numel, max_numel))


@dataclass(frozen=True)
class GroupLayout:
    """One param group flattened with every parameter on a block boundary and split into `dp` equal partitions."""

    numels: Tuple[int, ...]  # elements of each parameter, in the group's flat order
    dp: int  # data-parallel size the group is partitioned over
    block: int = BLOCK_SIZE  # quantization block; every slot offset and partition boundary is a multiple of it
    kind = "flat"  # to_dict tag of a ShardedLayout's counterpart (a class attribute, not a field; never written)

    def __post_init__(self):
        if self.dp < 1:
            raise ValueError(f"GroupLayout: dp must be >= 1, got {self.dp}")
        if not self.numels:
            raise ValueError("GroupLayout: a param group needs at least one parameter")
        if any(n <= 0 for n in self.numels):
            raise ValueError(f"GroupLayout: every parameter needs at least one element, got numels {self.numels}")

    @cached_property
    def slots(self) -> Tuple[ParamSlot, ...]:
        slots, offset = [], 0
        last = len(self.numels) - 1
        for index, numel in enumerate(self.numels):
            padding = 0 if index == last else (-numel) % self.block
            slots.append(ParamSlot(index=index, numel=numel, offset=offset, padding=padding))
            offset += numel + padding
        return tuple(slots)

    @property
    def used_numel(self) -> int:
        """End of the last parameter in the flat buffer; everything after it is ZeRO's group padding."""
        last = self.slots[-1]
        return last.offset + last.numel

    @property
    def alignment(self) -> int:
        """What the flat buffer's length is a multiple of: one whole block per rank at least."""
        return self.block * self.dp

    @property
    def total_numel(self) -> int:
        return round_up(self.used_numel, self.alignment)

    @property
    def partition_size(self) -> int:
        return self.total_numel // self.dp

    @property
    def padding_numel(self) -> int:
        """Elements of padding in the whole flat buffer (between parameters and at the group tail)."""
        return self.total_numel - sum(self.numels)

    def tail_padding(self, rank: int) -> int:
        """Elements at the end of `rank`'s partition that belong to no parameter (DeepSpeed's `groups_padding`)."""
        start = rank * self.partition_size
        return self.partition_size - min(max(self.used_numel - start, 0), self.partition_size)

    def segments(self, rank: int, eight_bit: Sequence[bool]) -> Tuple[Segment, ...]:
        """The segment table of `rank`: each parameter piece inside its partition, in flat order."""
        if len(eight_bit) != len(self.numels):
            raise ValueError(f"GroupLayout.segments: {len(eight_bit)} precisions for {len(self.numels)} parameters")
        if not 0 <= rank < self.dp:
            raise ValueError(f"GroupLayout.segments: rank {rank} outside [0, {self.dp})")
        start = rank * self.partition_size
        end = start + self.partition_size
        rows, fp32_offset = [], 0
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo >= hi:
                continue
            is8 = bool(eight_bit[slot.index])
            rows.append(
                Segment(slot=slot.index, param_start=lo - slot.offset, numel=hi - lo, offset=lo - start,
                        eight_bit=is8, fp32_offset=-1 if is8 else fp32_offset))
            if not is8:
                fp32_offset += hi - lo
        return tuple(rows)

    def fp32_numel(self, rank: int, eight_bit: Sequence[bool]) -> int:
        """Length of `rank`'s compact fp32 state: the elements of its fp32-precision segments."""
        return sum(s.numel for s in self.segments(rank, eight_bit) if not s.eight_bit)

    def to_dict(self) -> dict:
        return {"numels": list(self.numels), "dp": self.dp, "block": self.block}


@dataclass(frozen=True)
class ShardedLayout:
    """One param group under ZeRO-3: each parameter split on its own into `dp` equal, block-aligned slices.

    A rank's partition is its slice of every parameter, in group order; ZeRO-3 sub-groups are runs of consecutive
    parameters, each described by the ShardedLayout of its own numels. Same interface as GroupLayout.
    """

    numels: Tuple[int, ...]  # elements of each parameter, in the group's order
    dp: int  # data-parallel size every parameter is partitioned over
    block: int = BLOCK_SIZE  # every slice is a multiple of it (1: stock ZeRO-3, slices of ceil(numel / dp))
    kind = "sharded"  # to_dict tag (a class attribute, not a field)

    def __post_init__(self):
        if self.dp < 1 or self.block < 1:
            raise ValueError(f"ShardedLayout: dp and block must be >= 1, got dp={self.dp}, block={self.block}")
        if not self.numels:
            raise ValueError("ShardedLayout: a param group needs at least one parameter")
        if any(n <= 0 for n in self.numels):
            raise ValueError(f"ShardedLayout: every parameter needs at least one element, got numels {self.numels}")

    def slice_numel(self, index: int) -> int:
        """Elements of parameter `index` on every rank, padding included (DeepSpeed's `partition_numel()`)."""
        return round_up(self.numels[index], self.block * self.dp) // self.dp

    @cached_property
    def offsets(self) -> Tuple[int, ...]:
        """Where each parameter's slice starts inside every rank's partition (the same on every rank)."""
        out, offset = [], 0
        for index in range(len(self.numels)):
            out.append(offset)
            offset += self.slice_numel(index)
        return tuple(out)

    @property
    def partition_size(self) -> int:
        return self.offsets[-1] + self.slice_numel(len(self.numels) - 1)

    @property
    def total_numel(self) -> int:
        return self.partition_size * self.dp

    @property
    def padding_numel(self) -> int:
        """Elements of padding over all ranks (after each parameter, up to its slices' common size)."""
        return self.total_numel - sum(self.numels)

    def tail_padding(self, rank: int) -> int:
        """Always 0: ZeRO-3 keeps each rank's whole partition, padding included, in checkpoints."""
        return 0

    def segments(self, rank: int, eight_bit: Sequence[bool]) -> Tuple[Segment, ...]:
        """The segment table of `rank`: the non-empty part of each parameter's slice, in group order."""
        if len(eight_bit) != len(self.numels):
            raise ValueError(f"ShardedLayout.segments: {len(eight_bit)} precisions for {len(self.numels)} parameters")
        if not 0 <= rank < self.dp:
            raise ValueError(f"ShardedLayout.segments: rank {rank} outside [0, {self.dp})")
        rows, fp32_offset = [], 0
        for index, (numel, offset) in enumerate(zip(self.numels, self.offsets)):
            size = self.slice_numel(index)
            start = rank * size
            length = min(numel - start, size)
            if length <= 0:
                continue  # a rank past the end of a small parameter owns none of it
            is8 = bool(eight_bit[index])
            rows.append(Segment(slot=index, param_start=start, numel=length, offset=offset, eight_bit=is8,
                                fp32_offset=-1 if is8 else fp32_offset))
            if not is8:
                fp32_offset += length
        return tuple(rows)

    def fp32_numel(self, rank: int, eight_bit: Sequence[bool]) -> int:
        return sum(s.numel for s in self.segments(rank, eight_bit) if not s.eight_bit)

    def sub_layout(self, start: int, stop: int) -> "ShardedLayout":
        """The layout of parameters [start, stop): a ZeRO-3 sub-group's flat partition."""
        return ShardedLayout(numels=self.numels[start:stop], dp=self.dp, block=self.block)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "numels": list(self.numels), "dp": self.dp, "block": self.block}


def layout_from_dict(data: dict):
    """GroupLayout or ShardedLayout from its to_dict() (a dict without "kind" is a GroupLayout: format 1 files).
    The dict comes from a file: anything but positive integers (at most MAX_BLOCK for the block) is a ValueError."""
    def count(value, what, limit=None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (limit and value > limit):
            raise ValueError(f"layout {what} must be an integer from 1{f' to {limit}' if limit else ''}, got "
                             f"{value!r}")
        return value

    if not isinstance(data, dict) or not isinstance(data.get("numels"), (list, tuple)) or \
            data.get("kind", GroupLayout.kind) not in (GroupLayout.kind, ShardedLayout.kind):
        raise ValueError(f"not a layout (a dict of kind, numels, dp, block): {str(data)[:200]}")
    cls = ShardedLayout if data.get("kind") == ShardedLayout.kind else GroupLayout
    return cls(numels=tuple(count(n, "numel") for n in data["numels"]), dp=count(data.get("dp"), "dp"),
               block=count(data.get("block"), "block", MAX_BLOCK))


def zero_alignment(stock_alignment: int, layout: GroupLayout) -> int:
    """The flat-buffer alignment to hand DeepSpeed: its own (NCCL start alignment * dp) and ours together."""
    return math.lcm(stock_alignment, layout.alignment)
