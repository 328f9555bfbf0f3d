"""Crafted torch files for the safe loader's tests: a protocol-2 pickle written opcode by opcode, packed the way
torch.save packs it (`archive/data.pkl`, one record per storage), and the attacks measured against torch 2.13's own
weights-only unpickler.

Every attack is small on disk and asks torch for work out of proportion to it, or for bytes outside its own: `ATTACKS`
maps a name to (builder, the error deepspeed_bnb's loader must give, what torch.load(weights_only=True) does with it,
the control). The sizes are chosen so that the controls finish in well under a second on a 2-core machine: each
control proves the file is live (torch accepts it and builds the oversized or wrong object), so that a refusal by the
safe loader is a refusal of a real attack.
"""

import struct
import zipfile

import torch

PROTO = b"\x80\x02"
MARK, TUPLE, TUPLE1, TUPLE2 = b"(", b"t", b"\x85", b"\x86"
REDUCE, BUILD, NEWOBJ, STOP = b"R", b"b", b"\x81", b"."
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, SETITEM, APPEND = b"}", b"]", b")", b"s", b"a"
BINPERSID, NEWFALSE, NONE = b"Q", b"\x89", b"N"


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def num(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -2 ** 31 <= value < 2 ** 31:
        return b"J" + struct.pack("<i", value)
    size = (value.bit_length() + 8) // 8
    return b"\x8a" + bytes([size]) + value.to_bytes(size, "little", signed=True)


def put(index: int) -> bytes:
    return b"q" + bytes([index])


def get(index: int) -> bytes:
    return b"h" + bytes([index])


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def storage(key: str, numel: int, kind: str = "FloatStorage") -> bytes:
    return tup(text("storage"), glob("torch", kind), text(key), text("cpu"), num(numel)) + BINPERSID


def tensor(storage_pid: bytes, size, stride, offset: int = 0) -> bytes:
    hooks = glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(storage_pid, num(offset), tup(*map(num, size)),
                                                              tup(*map(num, stride)), NEWFALSE, hooks) + REDUCE


def call(module: str, name: str, *args: bytes) -> bytes:
    return glob(module, name) + tup(*args) + REDUCE


def under_x(obj: bytes) -> bytes:
    """The pickle of {"x": obj}."""
    return PROTO + EMPTY_DICT + text("x") + obj + SETITEM + STOP


def write_archive(path: str, pickle_bytes: bytes, records=None, compression=zipfile.ZIP_STORED) -> str:
    """A torch.save-style archive: archive/data.pkl, the records under archive/data/, the version files."""
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", b"little")
        for key, raw in (records or {}).items():
            archive.writestr(f"archive/data/{key}", raw)
        archive.writestr("archive/version", b"3\n")
    return path


FLOATS = struct.pack("<10f", *range(10))  # one record of 10 float32


# ---- the attacks: builder(path) -> path ------------------------------------------------------------------------------

def zip_bomb(path):
    """A deflated record: 64 MiB of zeros in about 64 KB of file."""
    size = 16 << 20
    return write_archive(path, under_x(tensor(storage("0", size), (size,), (1,))), {"0": bytes(4 * size)},
                         compression=zipfile.ZIP_DEFLATED)


def storage_past_its_record(path):
    """A storage claiming more elements than its record holds: under mmap torch reads the bytes that follow."""
    return write_archive(path, under_x(tensor(storage("0", 20), (20,), (1,))), {"0": FLOATS, "1": FLOATS})


def stride_zero(path):
    """A view repeating one element 2**26 times (256 MiB once copied) over a 40-byte storage."""
    return write_archive(path, under_x(tensor(storage("0", 10), (1 << 26,), (0,))), {"0": FLOATS})


def bytearray_of(path):
    """bytearray(n): n bytes allocated from a number in the pickle (2**28 = 256 MiB)."""
    return write_archive(path, under_x(call("builtins", "bytearray", num(1 << 28))))


def untyped_storage(path):
    return write_archive(path, under_x(call("torch.storage", "UntypedStorage", num(1 << 28))))


def tensor_class(path):
    """torch.Tensor(n): an uninitialised tensor of n elements."""
    return write_archive(path, under_x(call("torch", "Tensor", num(1 << 26))))


def tensor_through_rebuild_from_type(path):
    """torch.Tensor(n) again, called by _rebuild_from_type_v2 (which stock ZeRO-3 files use with a tensor rebuild)."""
    return write_archive(path, under_x(call("torch._tensor", "_rebuild_from_type_v2", glob("torch", "Tensor"),
                                            glob("torch", "Tensor"), tup(num(1 << 26)), EMPTY_DICT)))


def copies_of_one_string(path):
    """One 64 KiB string, memoized, handed to 4000 bytes constructors (_codecs.encode): 256 MiB from a 120 KB file."""
    copies = b"".join(call("_codecs", "encode", get(1), text("latin1")) + APPEND for _ in range(4000))
    return write_archive(path, PROTO + EMPTY_DICT + text("s") + text("a" * (1 << 16)) + put(1) + SETITEM +
                         text("x") + EMPTY_LIST + copies + SETITEM + STOP)


def copies_of_one_list(path):
    """One list of 20000 items, memoized, handed to 2000 set() calls: 40 million set entries from a 90 KB file."""
    members = EMPTY_LIST + MARK + num(7) * 20000 + b"e"  # APPENDS
    copies = b"".join(call("builtins", "set", get(1)) + APPEND for _ in range(2000))
    return write_archive(path, PROTO + EMPTY_DICT + text("s") + members + put(1) + SETITEM + text("x") + EMPTY_LIST +
                         copies + SETITEM + STOP)


def nested_deep(path):
    """Lists nested 100000 deep: torch builds them, a recursive reader dies of RecursionError."""
    depth = 100000
    pickle_bytes = PROTO + EMPTY_DICT + text("x") + EMPTY_LIST * depth + APPEND * (depth - 1) + SETITEM + STOP
    return write_archive(path, pickle_bytes)


def loss_scale_zero(path):
    """A DeepSpeed loss scaler with cur_scale 0 (an allowed type with a value that divides by zero steps later)."""
    state = EMPTY_DICT + text("cur_scale") + b"G" + struct.pack(">d", 0.0) + SETITEM + text("dynamic") + NEWFALSE + \
        SETITEM
    obj = glob("deepspeed.runtime.fp16.loss_scaler", "LossScaler") + EMPTY_TUPLE + NEWOBJ + state + BUILD
    return write_archive(path, under_x(obj))


def legacy_format(path):
    """What torch.save(_use_new_zipfile_serialization=False) writes."""
    torch.save({"x": torch.arange(4.0)}, path, _use_new_zipfile_serialization=False)
    return path


def stack_global(path):
    """A protocol-4 global lookup (STACK_GLOBAL), which torch.save never writes."""
    return write_archive(path, PROTO + EMPTY_DICT + text("x") + text("builtins") + text("print") + b"\x93" +
                         SETITEM + STOP)


def stage_enum_seven(path):
    """ZeRO stage 7 (the enum's constructor refuses it inside torch's unpickler)."""
    return write_archive(path, under_x(call("deepspeed.runtime.zero.config", "ZeroStageEnum", num(7))))


def negative_fragment(path):
    """A param_slice_mappings entry starting at -5."""
    state = EMPTY_DICT + text("numel") + num(4) + SETITEM + text("start") + num(-5) + SETITEM
    obj = glob("deepspeed.utils.tensor_fragment", "fragment_address") + EMPTY_TUPLE + NEWOBJ + state + BUILD
    return write_archive(path, under_x(obj))
