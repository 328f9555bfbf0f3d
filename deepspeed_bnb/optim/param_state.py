"""One parameter's bitsandbytes optimizer state as a type: its tensors, what each key is, and how it is cut and joined.

bitsandbytes keeps per parameter 8-bit codes (one per element), absmax (one per 256-element block), a 256-entry map
and a step. ZeRO partitions, tensor-parallel splits, pipeline stages and universal checkpoints all cut or join that
state. A cut on block boundaries moves codes and absmax unchanged: the piece is byte for byte what bnb holds for the
piece, because bnb quantizes every block on its own and its update is element-wise. A cut inside a block would leave
two pieces sharing one absmax, so the pieces are requantized from the dequantized values instead. That only happens
when the caller passes a `Requantization` to count the blocks and the largest change; without one the cut is refused
(`OffBlockCut`), so precision is never lost silently. The model is torchao's OptimState8bit, which keeps codes, scale
and map together and refuses cuts off block boundaries.

The flat view is bnb's: element keys `(rows..., numel)` (AdEMAMix's state1 has two rows), block keys
`(rows..., blocks)`; whole keys (maps) and scalars (step) are the same for every piece.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from deepspeed_bnb.ops.reference import dequantize_blockwise, quantize_blockwise
from deepspeed_bnb.optim.state_classes import StateClass
from deepspeed_bnb.state_layout import BLOCK_SIZE


class OffBlockCut(ValueError):
    """A cut of 8-bit state inside a quantization block, where the caller did not allow requantization."""


@dataclass
class Requantization:
    """What requantizing cut 8-bit state changed: filled by every cut that had to requantize, read by the report."""

    blocks: int = 0  # quantization blocks written anew (per row of each 8-bit key)
    largest_change: float = 0.0  # the largest |new - old| of a dequantized value
    keys: set = field(default_factory=set)  # the 8-bit keys that were requantized

    def add(self, key: str, blocks: int, change: float) -> None:
        self.blocks += blocks
        self.largest_change = max(self.largest_change, change)
        self.keys.add(key)

    def __str__(self) -> str:
        if not self.blocks:
            return "no block requantized (every cut on a block boundary)"
        return (f"{self.blocks:,} blocks of {', '.join(sorted(self.keys))} requantized (a cut inside a 256-element "
                f"block); largest change of a dequantized value {self.largest_change:.3g}")


@dataclass(frozen=True)
class Run:
    """A contiguous stretch of elements moved from a source state into an assembled one."""

    source: int  # index of the source state
    start: int  # first element in the source
    length: int  # elements


def _suffix(key: str) -> str:
    match = re.search(r"(\d+)$", key)
    return match.group(1) if match else ""


class ParamState(Mapping):
    """The optimizer state of one parameter (or of a piece of it): a read-only mapping of bnb's state keys to their
    values, as bnb holds them, plus the class of every key and how many elements the state covers."""

    def __init__(self, values: Dict[str, object], classes: Dict[str, StateClass], numel: Optional[int] = None,
                 block: int = BLOCK_SIZE):
        self.values = dict(values)  # bnb's state keys -> tensors (flattened) or scalars
        self.classes = {k: classes[k] for k in self.values}  # the class of every key in values
        self.block = block  # elements per quantization block (bnb's blockwise optimizers: 256)
        if numel is None:
            lengths = {v.shape[-1] for k, v in self.values.items() if self.classes[k] == StateClass.ELEMENT}
            if len(lengths) != 1:
                raise ValueError(f"ParamState: cannot tell the number of elements from element keys of lengths "
                                 f"{sorted(lengths)}; pass numel")
            numel = lengths.pop()
        self.numel = numel  # elements of the parameter (or piece) this state covers
        for key, value in self.values.items():
            cls = self.classes[key]
            want = cls.length(numel, block)
            if want is not None and (not torch.is_tensor(value) or value.shape[-1] != want):
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(f"ParamState: {cls.value} key {key!r} has shape {shape}, but {numel} elements need "
                                 f"{want} values in its last dimension")

    @classmethod
    def of(cls, state: Mapping, classes: Dict[str, StateClass], numel: Optional[int] = None,
           block: int = BLOCK_SIZE) -> "ParamState":
        """bnb's state dict of one parameter (keys without a class are not state: left out)."""
        return cls({k: v for k, v in state.items() if k in classes}, classes, numel, block)

    # serialized: plain tensors and builtins only, so the safe loader reads it back without running code
    RECORD_VERSION = 1  # goes up when an older reader would misread a record

    def to_record(self, leave_out: Sequence[str] = ()) -> dict:
        """This state as a record of plain values; `leave_out`: whole keys the writer stores once for all
        parameters (their class stays in the record; the reader hands their values to from_record)."""
        return {"version": self.RECORD_VERSION, "numel": self.numel, "block": self.block,
                "classes": {k: c.value for k, c in self.classes.items()},
                "values": {k: v for k, v in self.values.items() if k not in leave_out}}

    @classmethod
    def from_record(cls, record, numel: int, where: str, shared: Optional[Dict[str, object]] = None) -> "ParamState":
        """The state of a record written by to_record, for a parameter of `numel` elements; `shared`: the values of
        the whole keys it left out. Anything else than what to_record writes is refused, naming `where`."""
        fields = {"version", "numel", "block", "classes", "values"}
        if not isinstance(record, dict) or set(record) != fields:
            got = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: not a parameter-state record (fields {sorted(fields)}, got {got})")
        if record["version"] != cls.RECORD_VERSION:
            raise ValueError(f"{where}: parameter-state record version {record['version']!r}; this deepspeed_bnb "
                             f"reads version {cls.RECORD_VERSION}. Upgrade deepspeed_bnb to read it.")
        if record["numel"] != numel or record["block"] != BLOCK_SIZE:
            raise ValueError(f"{where}: the record is of {record['numel']!r} elements in blocks of "
                             f"{record['block']!r}; the parameter has {numel}, bnb's blocks {BLOCK_SIZE}")
        classes, values = dict(record["classes"]), dict(record["values"])
        known = {c.value: c for c in StateClass}
        if not set(values) <= set(classes) or not all(isinstance(k, str) and classes[k] in known for k in classes):
            raise ValueError(f"{where}: the record's classes {classes} do not name each of its values "
                             f"{sorted(values)} with one of {sorted(known)}")
        for key in set(classes) - set(values):  # whole keys stored once, beside the records
            if classes[key] != StateClass.WHOLE.value or key not in (shared or {}):
                raise ValueError(f"{where}: {key!r} ({classes[key]}) has no value, in the record or stored once")
            values[key] = shared[key]
        for key, value in values.items():
            if not (torch.is_tensor(value) or (isinstance(value, (int, float)) and not isinstance(value, bool))):
                raise ValueError(f"{where}: {key!r} holds {type(value).__name__}, not a tensor or a number")
        classes = {k: known[v] for k, v in classes.items()}
        try:
            state = cls(values, classes, numel)
            for key in [k for k in state.values if state._is_codes(k)]:
                qmap = state.values[state.partner(key, StateClass.WHOLE)]
                absmax = state.values[state.partner(key, StateClass.BLOCK)]
                if not (torch.is_tensor(qmap) and qmap.shape == (256,) and qmap.is_floating_point()
                        and absmax.is_floating_point()):
                    raise ValueError(f"8-bit key {key!r} needs a 256-value float map and float block scales")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return state

    # the mapping bnb's own state dict is, so code written for a dict reads a ParamState unchanged
    def __getitem__(self, key: str):
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        keys = ", ".join(f"{k}: {self.classes[k].value}" for k in self.values)
        return f"ParamState(numel={self.numel}, {'8-bit' if self.eight_bit else '32-bit'}, {{{keys}}})"

    def whole(self) -> Dict[str, object]:
        """The whole keys' values (the maps: the same for every parameter of the optimizer)."""
        return {k: v for k, v in self.values.items() if self.classes[k] == StateClass.WHOLE}

    @property
    def eight_bit(self) -> bool:
        return any(self._is_codes(k) for k in self.values)

    def _is_codes(self, key: str) -> bool:
        value = self.values[key]
        return self.classes[key] == StateClass.ELEMENT and torch.is_tensor(value) and value.dtype == torch.uint8

    def partner(self, key: str, cls: StateClass) -> str:
        """The block- or whole-class key that goes with 8-bit element key `key` (state1 -> absmax1, qmap1)."""
        matches = [k for k, c in self.classes.items() if c == cls and _suffix(k) == _suffix(key)]
        if len(matches) != 1:
            raise ValueError(f"ParamState: 8-bit key {key!r} has {len(matches)} {cls.value}-class partners "
                             f"({matches}); its codes cannot be read without exactly one")
        return matches[0]

    def dequantized(self, key: str) -> torch.Tensor:
        """An element key's values in fp32, `(rows..., numel)`: each code's map value times its block's absmax."""
        value = self.values[key]
        if not self._is_codes(key):
            return value.float()
        absmax = self.values[self.partner(key, StateClass.BLOCK)]
        qmap = self.values[self.partner(key, StateClass.WHOLE)]
        return dequantize_blockwise(value, absmax, qmap, self.block)

    @classmethod
    def assemble(cls, sources: Sequence["ParamState"], runs: Sequence[Run],
                 requantized: Optional[Requantization] = None, what: str = "state") -> "ParamState":
        """A new state of `runs` of `sources`, end to end. Runs that keep every block whole move codes and absmax
        unchanged; otherwise the 8-bit keys are requantized from their dequantized values when `requantized` is given
        (and counted there), and OffBlockCut is raised when it is not. Whole keys and scalars must agree."""
        first = sources[0]
        block, total = first.block, sum(run.length for run in runs)
        used = sorted({run.source for run in runs})
        for i in used:
            if set(sources[i].values) != set(first.values) or sources[i].eight_bit != first.eight_bit:
                raise ValueError(f"{what}: its pieces hold different state ({first!r} vs {sources[i]!r}); they are "
                                 f"not pieces of one parameter")
        at, aligned = 0, True
        for run in runs:
            size = sources[run.source].numel
            if run.start < 0 or run.length < 0 or run.start + run.length > size:
                raise ValueError(f"{what}: elements [{run.start}, {run.start + run.length}) are outside a piece of "
                                 f"{size} elements")
            ends_both = run.start + run.length == size and at + run.length == total
            aligned &= run.start % block == 0 and at % block == 0 and (run.length % block == 0 or ends_both)
            at += run.length
        values = {}
        for key, kind in first.classes.items():
            if kind.partitioned and (aligned or (kind == StateClass.ELEMENT and not first._is_codes(key))):
                values[key] = torch.cat([kind.narrow(sources[r.source].values[key], r.start, r.length, block)
                                         for r in runs], dim=-1)
            elif not kind.partitioned:
                values[key] = first.values[key]
                for i in used:
                    if not _same(sources[i].values[key], values[key]):
                        raise ValueError(f"{what}: its pieces disagree on {key!r} ({kind.value}: one value for every "
                                         f"piece of a parameter): {_brief(values[key])} vs "
                                         f"{_brief(sources[i].values[key])}")
        if not aligned and first.eight_bit:
            if requantized is None:
                raise OffBlockCut(
                    f"{what}: a cut falls inside a {block}-element quantization block of 8-bit state, where the codes "
                    f"of two pieces would share one absmax; moving it needs requantization (within half a "
                    f"quantization step per value), which this caller does not allow")
            for key in [k for k in first.classes if first._is_codes(k)]:
                old = torch.cat([sources[r.source].dequantized(key).narrow(-1, r.start, r.length) for r in runs],
                                dim=-1)
                block_key = first.partner(key, StateClass.BLOCK)
                qmap = first.values[first.partner(key, StateClass.WHOLE)]
                quantized = [quantize_blockwise(row, qmap, block) for row in old.reshape(-1, total)]
                codes = torch.stack([c for c, _ in quantized]).reshape(old.shape)
                absmax = torch.stack([a for _, a in quantized]).reshape(*old.shape[:-1], -1)
                values[key], values[block_key] = codes, absmax.to(first.values[block_key].dtype)
                new = dequantize_blockwise(codes, absmax, qmap, block)
                requantized.add(key, absmax.numel(), float((new - old).abs().max()) if old.numel() else 0.0)
        return cls(values, first.classes, total, block)

    def piece(self, start: int, length: int, requantized: Optional[Requantization] = None) -> "ParamState":
        """Elements [start, start + length) of this state (a ZeRO segment, a pipeline stage's share)."""
        return self.assemble([self], [Run(0, start, length)], requantized, f"elements [{start}, {start + length})")

    @classmethod
    def concat(cls, pieces: Sequence["ParamState"], requantized: Optional[Requantization] = None,
               what: str = "state") -> "ParamState":
        """The pieces end to end (a parameter's ZeRO segments in rank order)."""
        return cls.assemble(pieces, [Run(i, 0, p.numel) for i, p in enumerate(pieces)], requantized, what)

    def split(self, shape: Sequence[int], dim: int, parts: int, requantized: Optional[Requantization] = None,
              what: str = "parameter") -> List["ParamState"]:
        """The state of each of `parts` equal slices along `dim` of the parameter of `shape` (a tensor-parallel split:
        slice p holds indices [p * n, (p + 1) * n) of that dimension)."""
        shape = tuple(shape)
        if not 0 <= dim < len(shape) or parts < 1 or shape[dim] % parts:
            raise ValueError(f"{what}: dimension {dim} of shape {shape} cannot be split into {parts} equal parts "
                             f"(the tensor-parallel size must divide it)")
        width = shape[dim] // parts
        return [self.slice(shape, dim, p * width, width, requantized, f"{what}, slice {p} of {parts} along "
                                                                     f"dimension {dim}") for p in range(parts)]

    def slice(self, shape: Sequence[int], dim: int, start: int, width: int,
              requantized: Optional[Requantization] = None, what: str = "parameter") -> "ParamState":
        """The state of indices [start, start + width) along `dim` of the parameter of `shape` (one tensor-parallel
        rank's slice, even or not)."""
        shape = tuple(shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"{what}: shape {shape} has {math.prod(shape)} elements, its state {self.numel}")
        if not 0 <= dim < len(shape) or start < 0 or width < 0 or start + width > shape[dim]:
            raise ValueError(f"{what}: [{start}, {start + width}) along dimension {dim} is not inside shape {shape}")
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        return self.assemble([self], [Run(0, (o * shape[dim] + start) * inner, width * inner) for o in range(outer)],
                             requantized, what)

    @classmethod
    def join(cls, pieces: Sequence["ParamState"], shape: Sequence[int], dim: int,
             requantized: Optional[Requantization] = None, what: str = "parameter") -> "ParamState":
        """The inverse of split: the state of the parameter of `shape` whose slices along `dim` are `pieces`, in
        order: equal slices, or uneven ones (AutoTP cuts a vocabulary that its size does not divide unevenly)."""
        shape, parts = tuple(shape), len(pieces)
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        widths = [p.numel // (outer * inner) if outer * inner else 0 for p in pieces]
        if (not 0 <= dim < len(shape) or not parts or sum(widths) != shape[dim]
                or any(p.numel != outer * w * inner for p, w in zip(pieces, widths))):
            raise ValueError(f"{what}: {parts} slices of {[p.numel for p in pieces]} elements cannot make a "
                             f"parameter of shape {shape} along dimension {dim}")
        return cls.assemble(pieces, [Run(p, o * w * inner, w * inner) for o in range(outer)
                                     for p, w in enumerate(widths)],
                            requantized, f"{what}, joined from {parts} slices along dimension {dim}")


def _same(a, b) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return float(a) == float(b)
    return a == b


def _brief(value) -> str:
    if torch.is_tensor(value) and value.numel() > 1:
        return f"a {tuple(value.shape)} tensor"
    return repr(value.item() if torch.is_tensor(value) else value)
