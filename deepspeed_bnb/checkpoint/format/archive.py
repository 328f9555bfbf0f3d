"""Checks a torch file before anything in it is unpickled, so that reading it costs what its bytes say.

torch.save writes a zip archive: `<name>/data.pkl` (a protocol-2 pickle that rebuilds the object around the tensors)
and one uncompressed record per storage, which the pickle names by key with its element count. torch's weights-only
unpickler refuses arbitrary callables, but still lets a file ask for work out of proportion to its size (measured on
torch 2.13): `builtins.bytearray(n)`, `torch.storage.UntypedStorage(n)`, `torch.Tensor(n)` and the sparse,
quantized and device rebuilds allocate memory named by a number in the pickle (a sparse rebuild can even crash the
process); a record stored deflated inflates without bound (a 2 MB file loaded 2 GiB); a memoized object handed to
many constructor calls is copied by each (a 2 KB pickle of one string and 4000 `_codecs.encode` calls took 4 GB);
and under `mmap=True` torch takes a storage's element count from the pickle without comparing it with its record,
so a storage can run past its own bytes into the rest of the file. `check_archive` therefore requires, before any
load:
- the zip format (legacy torch.save files and raw pickles are refused with the way out: they cannot be read without
  full pickle);
- every record stored uncompressed, inside the file, records not overlapping;
- a pickle of the opcodes torch's weights-only unpickler reads, naming only CALLED and DATA (what torch.save uses for
  tensors and containers), storage and dtype names, and the DeepSpeed value types of safe_load.ALLOWED_GLOBALS;
- every storage the pickle names a record of exactly its element count times its element size;
- constructor calls that together copy no more than the pickle's own size (each memoized object may be handed to a
  constructor about once, as torch.save's pickles do).
The pickle is run on a small symbolic stack (nothing is built: strings and numbers, tuples and the sizes of
containers), so the check costs time proportional to the pickle and no memory beyond it.
"""

import _compat_pickle
import functools
import os
import pickletools
import zipfile
from typing import Iterable

import torch

from deepspeed_bnb.checkpoint.format.errors import TRUST_ENV, CheckpointMismatchError, UnsafeCheckpointError, refusal

ZIP_MAGIC = b"PK\x03\x04"
# What torch.save's pickle names besides storages and dtypes (every file of ZeRO-1/2/3, bf16 and universal
# checkpoints, stock and deepspeed_bnb, names no other), and the plain values a client_state may hold. CALLED may be
# called (REDUCE, NEWOBJ): containers, tensor and parameter rebuilds, shapes, devices, bytes, sets, complex numbers
# (what each copies of its arguments is charged); a tensor with attributes (stock ZeRO-3's fp32_flat_groups) is
# rebuilt through `_rebuild_from_type_v2`, whose own arguments must then be a tensor rebuild and a tensor type. DATA
# may only be handed to those (the type argument of `_rebuild_from_type_v2`): `torch.Tensor(n)` itself would allocate.
# Everything else torch's weights-only unpickler admits is refused: bytearray(n), UntypedStorage(n), TypedStorage(n)
# and the tensor classes as constructors (allocations sized by a number in the pickle), sparse, nested, quantized,
# meta and device rebuilds (no checkpoint of a ZeRO run holds them).
REBUILDS = ("torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter")
TENSOR_TYPES = ("torch.Tensor", "torch.nn.parameter.Parameter")
CALLED = frozenset({"collections.OrderedDict", *REBUILDS, "torch._tensor._rebuild_from_type_v2", "torch.Size",
                    "torch.device", "_codecs.encode", "builtins.set", "builtins.complex"})
DATA = frozenset(TENSOR_TYPES)
# The opcodes torch's weights-only unpickler reads (torch/_weights_only_unpickler.py); a pickle with another one is
# not torch.save's (torch would refuse it too, with a less clear message).
OPCODES = frozenset({"PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM",
                     "SETITEMS", "MARK", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE",
                     "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "BININT", "BININT1", "BININT2",
                     "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "LONG1", "BINPERSID", "BINGET", "LONG_BINGET",
                     "BINPUT", "LONG_BINPUT"})
COPY_ALLOWANCE = 1 << 16  # elements constructor calls may copy beyond the pickle's size in bytes
_SHORT = 256  # strings up to this length keep their text on the symbolic stack (storage keys, 'cpu', 'storage')


@functools.lru_cache(maxsize=1)
def _storage_and_dtype_globals() -> frozenset:
    """`torch.FloatStorage`-style names (how torch.save names the storage class of each tensor's record) and dtype
    names (`torch.float16`); the raw storage classes, which construct a storage of any size, are not among them."""
    names = {str(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}
    names |= {f"{cls.__module__}.{cls.__name__}" for cls in torch._storage_classes
              if cls not in (torch.storage.UntypedStorage, torch.storage.TypedStorage)}
    return frozenset(names)


def not_a_torch_archive(path: str, head: bytes) -> str:
    kind = "a raw pickle or a legacy torch.save file (torch < 1.6 format)" if head[:1] == b"\x80" else \
        "not a torch.save file"
    return (f"{path} is {kind}, not the zip archive torch.save writes: deepspeed_bnb's safe loader reads only that "
            f"format, since the others cannot be read without unpickling them in full. If you trust the file, load "
            f"it with {TRUST_ENV}=1 (or --trust), then save it again with a current torch.")


def check_archive(path: str, allowed: Iterable[str]) -> None:
    """Raise CheckpointMismatchError (UnsafeCheckpointError for a refused global) unless `path` is a torch zip archive
    whose records lie uncompressed inside the file, whose pickle names only CALLED, DATA, storage and dtype names, or
    `allowed` (dotted names), whose storages match their records, and whose constructor calls copy no more than the
    pickle holds."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(4)
    if head != ZIP_MAGIC:
        raise CheckpointMismatchError(not_a_torch_archive(path, head))
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            pickles = [r for r in records if r.filename.count("/") == 1 and r.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise CheckpointMismatchError(f"{path} holds {len(pickles)} top-level data.pkl records, not one: it "
                                              f"is not a torch.save archive.")
            _check_records(path, records, size)
            data = archive.read(pickles[0])
    except zipfile.BadZipFile as exc:
        raise CheckpointMismatchError(f"{path} is damaged: its zip directory cannot be read ({exc}); the file is "
                                      f"truncated or corrupted.") from exc
    prefix = pickles[0].filename[:-len("data.pkl")]
    sizes = {r.filename[len(prefix) + len("data/"):]: r.file_size for r in records
             if r.filename.startswith(prefix + "data/")}
    _Simulation(path, set(allowed), sizes, len(data)).run(data)


def _check_records(path: str, records, size: int) -> None:
    end = 0
    for record in sorted(records, key=lambda r: r.header_offset):
        if record.compress_type != zipfile.ZIP_STORED or record.compress_size != record.file_size:
            raise CheckpointMismatchError(
                f"{path}: record {record.filename!r} is compressed ({record.file_size:,} bytes from "
                f"{record.compress_size:,}); torch.save stores every record as is, and a compressed one can inflate "
                f"far beyond the file (a zip bomb). The file was not written by torch.save: refused.")
        if record.header_offset < end or record.header_offset + record.compress_size > size:
            raise CheckpointMismatchError(f"{path}: record {record.filename!r} overlaps another or lies outside the "
                                          f"file ({size:,} bytes); the archive is damaged or crafted: refused.")
        end = record.header_offset + record.compress_size


class _Str:
    """A string on the symbolic stack: its length, and its text when short."""

    def __init__(self, text: str):
        self.length, self.text = len(text), text if len(text) <= _SHORT else None


class _Global:
    def __init__(self, name: str):
        self.name = name


class _Box:
    """A container or constructed object on the symbolic stack: how many elements a constructor copying it takes."""

    def __init__(self, size: int = 0, items: tuple = ()):
        self.size, self.items = size, items  # items: a tuple's members (its only use: reading storage ids)


_MARK = object()
_OPAQUE = _Box(1)  # numbers, None, booleans: one element, nothing to copy


class _Simulation:
    """torch.save's pickle run on a symbolic stack; see the module docstring for what it checks."""

    def __init__(self, path: str, allowed: set, records: dict, pickle_bytes: int):
        self.path, self.records = path, records
        self.known = CALLED | DATA | _storage_and_dtype_globals() | allowed
        self.callable = CALLED | allowed
        self.budget = pickle_bytes + COPY_ALLOWANCE
        self.stack, self.memo = [], {}

    def run(self, data: bytes) -> None:
        try:
            for opcode, arg, _ in pickletools.genops(data):
                self.step(opcode.name, arg)
        except (ValueError, EOFError, IndexError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointMismatchError(f"{self.path} is damaged: its pickle (data.pkl) does not parse as torch.save "
                                          f"writes it ({type(exc).__name__}: {exc}).") from None

    def pop_mark(self) -> list:
        at = len(self.stack) - 1 - self.stack[::-1].index(_MARK)
        items = self.stack[at + 1:]
        del self.stack[at:]
        return items

    @staticmethod
    def shallow(value) -> int:
        """Elements a shallow copy of `value` takes (a container's members, a string's characters)."""
        if isinstance(value, _Str):
            return value.length
        return value.size if isinstance(value, _Box) else 1

    def charge(self, args) -> int:
        """A constructor's arguments: each may be copied once, shallowly (OrderedDict(pairs), a state dict)."""
        cost = self.shallow(args) + sum(self.shallow(item) for item in getattr(args, "items", ()))
        self.budget -= cost
        if self.budget < 0:
            raise CheckpointMismatchError(
                f"{self.path}: its pickle hands the same objects to constructors over and over, which would copy "
                f"more than the file holds (memory out of proportion to its size). torch.save never writes that: "
                f"refused.")
        return cost

    def step(self, name: str, arg) -> None:
        stack = self.stack
        if name not in OPCODES:
            raise UnsafeCheckpointError(refusal(self.path, f"the pickle opcode {name}, which torch.save does not "
                                                           f"write,"))
        if name == "GLOBAL":
            dotted = ".".join(_python3_name(*arg.split(" ", 1)))
            if dotted not in self.known:
                raise UnsafeCheckpointError(refusal(self.path, f"the object {dotted}"))
            stack.append(_Global(dotted))
        elif name in ("BINUNICODE", "SHORT_BINSTRING"):
            stack.append(_Str(arg if isinstance(arg, str) else arg.decode("latin-1")))
        elif name in ("BININT", "BININT1", "BININT2", "LONG1"):
            stack.append(arg)
        elif name in ("BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE"):
            stack.append(_OPAQUE)
        elif name == "MARK":
            stack.append(_MARK)
        elif name in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"):
            stack.append(_Box())
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            items = self.pop_mark() if name == "TUPLE" else [stack.pop() for _ in range(int(name[-1]))][::-1]
            stack.append(_Box(len(items), tuple(items)))
        elif name == "APPEND":
            stack.pop()
            stack[-1].size += 1
        elif name in ("APPENDS", "SETITEMS"):
            added = len(self.pop_mark()) // (2 if name == "SETITEMS" else 1)
            stack[-1].size += added
        elif name == "SETITEM":
            del stack[-2:]
            stack[-1].size += 1
        elif name in ("BINPUT", "LONG_BINPUT"):
            self.memo[arg] = stack[-1]
        elif name in ("BINGET", "LONG_BINGET"):
            stack.append(self.memo[arg])
        elif name in ("REDUCE", "NEWOBJ"):  # a constructor: what it may copy of its arguments is charged
            args = stack.pop()
            self.check_call(stack.pop(), args)
            stack.append(_Box(self.charge(args)))
        elif name == "BUILD":  # an object's state set from a dict: copied into it
            self.charge(_Box(0, (stack.pop(),)))
        elif name == "BINPERSID":
            self.storage(stack.pop())
            stack.append(_OPAQUE)
        # PROTO, STOP: nothing on the stack

    def check_call(self, func, args) -> None:
        """Only CALLED and the DeepSpeed types are called; `_rebuild_from_type_v2` only on a tensor rebuild and a
        tensor type (torch.save's form), since it calls its first argument with the rest."""
        name = func.name if isinstance(func, _Global) else None
        if name not in self.callable:
            raise UnsafeCheckpointError(refusal(self.path, f"a call of {name or 'an object built by the pickle'}"))
        if name == "torch._tensor._rebuild_from_type_v2":
            items = getattr(args, "items", ())
            if len(items) != 4 or not (isinstance(items[0], _Global) and items[0].name in REBUILDS and
                                       isinstance(items[1], _Global) and items[1].name in TENSOR_TYPES):
                raise UnsafeCheckpointError(refusal(self.path, "a _rebuild_from_type_v2 call of another function or "
                                                               "type than a tensor rebuild"))

    def storage(self, pid) -> None:
        """A storage id ('storage', storage type, key, location, element count): its record must hold exactly that
        many elements (torch compares them without mmap only)."""
        items = pid.items if isinstance(pid, _Box) else ()
        kind, cls, key, _, count = items if len(items) == 5 else (None,) * 5
        if not (isinstance(kind, _Str) and kind.text == "storage" and isinstance(cls, _Global) and
                isinstance(key, _Str) and key.text is not None and isinstance(count, int) and count >= 0):
            raise CheckpointMismatchError(f"{self.path}: its pickle names a storage it does not describe as "
                                          f"torch.save does; the file is damaged or crafted: refused.")
        element = _element_size(cls.name)
        record = self.records.get(key.text)
        if element is None or record != count * element:
            raise CheckpointMismatchError(
                f"{self.path}: storage {key.text!r} claims {count:,} elements of {cls.name}, but its record holds "
                f"{'no data' if record is None else f'{record:,} bytes'}; the file is damaged or crafted: refused.")


def _python3_name(module: str, name: str):
    """A protocol-2 global as Python 3 names it (`__builtin__ set` is `builtins.set`), as torch's unpickler maps it."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


@functools.lru_cache(maxsize=None)
def _element_size(storage_name: str):
    """Bytes per element of a `torch.FloatStorage`-style name (None for another name)."""
    try:
        dtype = torch.serialization.StorageType(storage_name.rsplit(".", 1)[-1]).dtype
    except Exception:  # not a legacy storage name
        return None
    return torch.empty(0, dtype=dtype).element_size()
