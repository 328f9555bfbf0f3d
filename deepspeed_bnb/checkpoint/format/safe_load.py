"""Reads checkpoint files without running code: torch's weights-only unpickler and a short allow-list of DeepSpeed
types.

A `.pt` file is a zip of raw tensor storages and a pickle that rebuilds the objects around them, and a pickle can
name any callable (`os.system`), which plain `torch.load(weights_only=False)` calls. DeepSpeed loads every checkpoint
file that way (TorchCheckpointEngine.load, zero_to_fp32, the universal loader), so a downloaded checkpoint can run a
payload at `engine.load_checkpoint`. Here every file deepspeed_bnb reads goes through `load_file`: torch's
weights-only unpickler (tensors, containers, numbers, strings, torch.Size/dtype/device) plus the few DeepSpeed types
that DeepSpeed's own ZeRO files hold (ALLOWED_GLOBALS, each a plain value type). Anything else is refused with
UnsafeCheckpointError naming the file and the object; a user who trusts a checkpoint opts in with TRUST_ENV=1 (or
`--trust` on the command line), and `deepspeed-bnb migrate --trust` rewrites such a checkpoint once in this format.
"""

import importlib
import os
import pickle
import re
import warnings
from typing import Optional

import torch

from deepspeed_bnb.checkpoint.format.errors import UnsafeCheckpointError

TRUST_ENV = "DEEPSPEED_BNB_TRUST_CHECKPOINTS"
"""Set to 1 to load checkpoint files with full pickle (arbitrary code), for checkpoints you trust. Off by default."""

# What DeepSpeed 0.19's ZeRO-1/2/3 files hold besides tensors and containers. All are value types rebuilt from
# their fields (no code of the file's choosing runs): the loss scaler (its scale and counters), the ZeRO stage enum,
# and the (numel, start) pairs of `param_slice_mappings`.
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_warned_trusted = set()


def trusted() -> bool:
    """Whether the user opted in to full-pickle loading (TRUST_ENV)."""
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes", "on")


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


def load_file(path: str, map_location="cpu", mmap: bool = False):
    """torch.load of `path` restricted to tensors, containers, numbers and ALLOWED_GLOBALS (full pickle only when the
    user set TRUST_ENV). Raises UnsafeCheckpointError naming the file and the refused object."""
    if trusted():
        if path not in _warned_trusted:
            _warned_trusted.add(path)
            warnings.warn(f"deepspeed_bnb: {TRUST_ENV} is set: {path} is loaded with full pickle, which runs any "
                          f"code the file names. Only do this for checkpoints you trust.", RuntimeWarning,
                          stacklevel=2)
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=False)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = refused_object(exc)
        what = f"the object {refused}" if refused else f"a pickle construct ({str(exc).splitlines()[0]})"
        raise UnsafeCheckpointError(
            f"{path} needs {what} to load, which deepspeed_bnb's safe loader does not allow: loading it would let "
            f"the file run code. deepspeed_bnb checkpoints never need it, so this file was written by another tool "
            f"or tampered with. If you trust this checkpoint (you or someone you trust wrote it), set {TRUST_ENV}=1 "
            f"for this load (or pass --trust to deepspeed-bnb), or rewrite it once in the safe format with "
            f"`deepspeed-bnb migrate SRC DST --trust`.") from exc
