"""Reads checkpoint files without running code, and at a cost bounded by their size: torch's weights-only unpickler,
a short allow-list of DeepSpeed value types, a check of the archive before it is read, and of the values after.

A `.pt` file is a zip of raw tensor storages and a pickle that rebuilds the objects around them, and a pickle can
name any callable (`os.system`), which plain `torch.load(weights_only=False)` calls. DeepSpeed loads every checkpoint
file that way (TorchCheckpointEngine.load, zero_to_fp32, the universal loader), so a downloaded checkpoint can run a
payload at `engine.load_checkpoint`. Here every file deepspeed_bnb reads goes through `load_file`:
1. archive.check_archive: the zip format, records stored uncompressed inside the file, the pickle naming only what
   torch.save uses for tensors and containers plus ALLOWED_GLOBALS (each a plain value type DeepSpeed's ZeRO files
   hold);
2. torch.load(weights_only=True, mmap=True) with those globals allowed: tensors stay in the file until touched;
3. check_values: every tensor lies inside its storage and does not repeat it (a stride-0 view of a few bytes can
   claim 10^12 elements), the DeepSpeed values hold sane numbers (a loss scale of 0 would divide by zero steps
   later), and the object walks in time proportional to the file (shared references cannot multiply it).
Anything refused raises UnsafeCheckpointError or CheckpointMismatchError naming the file and the object. A user who
trusts a checkpoint opts in with TRUST_ENV=1, or for a block of code with `trusting()` (`--trust` on the command
line); `deepspeed-bnb migrate --trust` rewrites such a checkpoint once in this format. `forced_weights_only()` makes
DeepSpeed's own torch.load calls weights-only with the same allow-list for the duration of a load (torch's
TORCH_FORCE_WEIGHTS_ONLY_LOAD): the routes deepspeed_bnb does not read itself get the unpickler's guarantee too.
"""

import contextlib
import contextvars
import importlib
import math
import os
import pickle
import re
import warnings
from typing import Optional

import torch

from deepspeed_bnb.checkpoint.format.archive import check_archive
from deepspeed_bnb.checkpoint.format.errors import TRUST_ENV, CheckpointMismatchError, UnsafeCheckpointError, \
    refusal

__all__ = ["TRUST_ENV", "load_file", "trusted", "trusting", "forced_weights_only", "allowed_globals"]

# What DeepSpeed's ZeRO-1/2/3 files hold besides tensors and containers. All are value types rebuilt from their fields
# (no code of the file's choosing runs; check_values checks the fields): the loss scaler (its scale and counters),
# the ZeRO stage enum, and the (numel, start) pairs of `param_slice_mappings`.
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
WALK_LIMIT = 1 << 22  # objects a file may unfold into when walked path by path (a legitimate file: about its count)
MAX_DEPTH = 64  # nesting of containers (DeepSpeed's files: under 10); deeper would exhaust a recursive reader's stack
FORCE_ENV, FORCE_NO_ENV = "TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch.load reads them

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_trust = contextvars.ContextVar("deepspeed_bnb_trust", default=False)
_warned_trusted = set()


def trusted() -> bool:
    """Whether full-pickle loading is opted in: TRUST_ENV, or inside `trusting()`."""
    return _trust.get() or os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def trusting():
    """Full-pickle loading for the block only (what `--trust` means to one tool call): nothing outlives it."""
    token = _trust.set(True)
    try:
        yield
    finally:
        _trust.reset(token)


def allowed_globals() -> list:
    """The allow-list as objects (imported here, by these fixed names: never by a name a file supplies)."""
    found = []
    for dotted in ALLOWED_GLOBALS:
        module, name = dotted.rsplit(".", 1)
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: that file cannot hold it either
            continue
    return found


def refused_object(exc: BaseException) -> Optional[str]:
    """The dotted name of the object torch's weights-only unpickler refused, if that is what `exc` reports."""
    match = _GLOBAL.search(str(exc))
    return match.group(1) if match else None


def load_file(path: str, map_location="cpu", mmap: bool = True):
    """torch.load of `path` restricted to tensors, containers, numbers and ALLOWED_GLOBALS, memory-mapped (full pickle
    only when trusted()). Raises UnsafeCheckpointError naming the file and the refused object, CheckpointMismatchError
    naming the file for anything else that makes it unreadable."""
    if not os.path.isfile(path):
        raise CheckpointMismatchError(f"{path} is missing or not a regular file.")
    if trusted():
        if path not in _warned_trusted:
            _warned_trusted.add(path)
            warnings.warn(f"deepspeed_bnb: {TRUST_ENV} is set: {path} is loaded with full pickle, which runs any "
                          f"code the file names. Only do this for checkpoints you trust.", RuntimeWarning,
                          stacklevel=2)
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=False)
    check_archive(path, ALLOWED_GLOBALS)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            value = torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = refused_object(exc)
        raise UnsafeCheckpointError(refusal(path, f"the object {refused}" if refused else
                                            f"a pickle construct ({str(exc).splitlines()[0]})")) from exc
    except Exception as exc:  # a damaged archive, a storage larger than its record, an enum value that is no stage
        raise CheckpointMismatchError(f"{path} cannot be read ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}); the file is truncated, "
                                      f"corrupted or was not written by torch.save.") from exc
    check_values(value, path)
    return value


@contextlib.contextmanager
def forced_weights_only():
    """Every torch.load in the block (DeepSpeed's own included, whatever weights_only it passes) uses the weights-only
    unpickler with ALLOWED_GLOBALS; a no-op when trusted(). torch reads TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call."""
    if trusted():
        yield
        return
    saved = {name: os.environ.get(name) for name in (FORCE_ENV, FORCE_NO_ENV)}
    os.environ[FORCE_ENV] = "1"
    os.environ.pop(FORCE_NO_ENV, None)  # torch refuses both at once
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- values ---------------------------------------------------------------------------------------------------------

def check_values(value, path: str) -> None:
    """Raise CheckpointMismatchError naming `path` unless every tensor in `value` lies inside its storage without
    repeating it, every DeepSpeed value type holds sane fields, and walking `value` path by path (what every reader
    does) visits at most WALK_LIMIT objects."""
    counts = {}  # id(container) -> objects below it, counted once per container

    def walk(item, where: str, depth: int) -> int:
        if torch.is_tensor(item):
            _check_tensor(item, path, where)
            return 1
        if isinstance(item, (dict, list, tuple, set, frozenset)):
            if depth > MAX_DEPTH:
                raise CheckpointMismatchError(f"{path}: {where} nests containers more than {MAX_DEPTH} deep; a "
                                              f"checkpoint never does. The file is crafted: refused.")
            key = id(item)
            if key not in counts:
                counts[key] = 0  # a cycle (not expressible in these pickles) would count as nothing
                children = item.items() if isinstance(item, dict) else enumerate(item)
                counts[key] = 1 + sum(walk(child, f"{where}/{name}", depth + 1) for name, child in children)
                if counts[key] > WALK_LIMIT:
                    raise CheckpointMismatchError(
                        f"{path}: {where or 'the file'} unfolds into more than {WALK_LIMIT:,} objects (references "
                        f"shared many times over); a checkpoint never does. The file is crafted: refused.")
            return counts[key]
        _check_deepspeed_value(item, path, where)
        return 1

    walk(value, "", 0)


def _check_tensor(tensor: torch.Tensor, path: str, where: str) -> None:
    storage = tensor.untyped_storage().nbytes()
    needed = tensor.numel() * tensor.element_size()
    if tensor.numel() and (any(s < 0 for s in tensor.stride()) or needed > storage):
        raise CheckpointMismatchError(
            f"{path}: tensor {where or '(the file)'} claims {tensor.numel():,} elements of {tensor.element_size()} "
            f"bytes over a storage of {storage:,} bytes (strides {tensor.stride()}): it repeats or leaves its data. "
            f"torch.save never writes that; the file is crafted or damaged: refused.")


def _number(value, low: float, integer: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return False
    return math.isfinite(value) and value >= low


# field -> (lowest value, must be an integer); other fields of a loss scaler must be booleans or a dtype
_SCALER_NUMBERS = {"cur_scale": (1e-45, False), "cur_iter": (0, True), "last_overflow_iter": (-1, True),
                   "scale_factor": (1e-45, False), "scale_window": (1, True), "min_scale": (1e-45, False),
                   "delayed_shift": (1, True), "cur_hysteresis": (0, True)}
_SCALER_FLAGS = ("dynamic", "consecutive_hysteresis", "raise_error_at_min_scale")


def _check_deepspeed_value(item, path: str, where: str) -> None:
    module = type(item).__module__
    if not module.startswith("deepspeed."):
        return
    name = type(item).__name__
    problem = None
    if name in ("LossScaler", "DynamicLossScaler"):
        for field, value in vars(item).items():
            if field in _SCALER_NUMBERS:
                low, integer = _SCALER_NUMBERS[field]
                ok = _number(value.item() if torch.is_tensor(value) and value.numel() == 1 else value, low, integer)
            elif field in _SCALER_FLAGS:
                ok = isinstance(value, bool)
            elif field == "dtype":
                ok = isinstance(value, torch.dtype)
            else:  # a field of a later release is data; one that shadows a method or property is not
                ok = not hasattr(type(item), field)
            if not ok:
                problem = f"field {field}={value!r}"
                break
    elif name == "fragment_address":
        if not all(_number(getattr(item, field, None), 0, integer=True) for field in ("numel", "start")):
            problem = f"{vars(item)!r} (numel and start must be integers >= 0)"
    if problem:
        raise CheckpointMismatchError(f"{path}: {where or 'the file'} holds a DeepSpeed {name} with {problem}, which "
                                      f"no run writes; the file is damaged or crafted: refused.")
