"""Deterministic faults in a checkpoint save, and what a load must give back (the crash-safety tests' harness).

`watch(root)` patches, for the duration of a block, every function through which a save changes files (deepspeed_bnb's
publish protocol and the stock DeepSpeed writer it wraps); each call on a path under `root` is recorded as a `Step`,
anything else passes through untouched. With `fail_at=N` the Nth recorded call (from 0) does not happen and `on_fault`
runs instead (default: raise InjectedFault; a child process can SIGKILL itself there); with `torn=True` a call that is
not atomic (a file write, a tree removal) is first half done, as a crash in the middle of it would leave it.
Production code has no hook: nothing here costs a save anything outside a test.
"""

import builtins
import contextlib
import os
import shutil
from dataclasses import dataclass
from typing import Callable, List, Optional

import deepspeed.runtime.engine as ds_engine
import pytest
import torch

# The calls that change a checkpoint directory: (module, attribute, step kind, index of the path argument, index of
# the destination argument or None). DeepSpeed copies its recovery scripts with `copyfile` imported into its engine
# module, so that name is patched there; `open` counts only in a writing mode.
WATCHED = (
    (os, "makedirs", "makedirs", 0, None),
    (shutil, "rmtree", "rmtree", 0, None),
    (os, "rename", "rename", 0, 1),
    (os, "replace", "replace", 0, 1),
    (os, "chmod", "chmod", 0, None),
    (torch, "save", "torch.save", 1, None),
    (ds_engine, "copyfile", "copyfile", 1, None),
    (builtins, "open", "write", 0, None),
)


class InjectedFault(RuntimeError):
    """The failure a test injected into a save (never raised by anything else)."""


@dataclass(frozen=True)
class Step:
    kind: str  # which call: one of WATCHED's step kinds
    path: str  # the path it changes, relative to the watched root, this process's id replaced by PID
    to: str = ""  # rename / replace: the destination, relative the same way

    def __str__(self):
        return f"{self.kind} {self.path}" + (f" -> {self.to}" if self.to else "")


def _relative(root: str, path) -> Optional[str]:
    if not isinstance(path, (str, os.PathLike)):
        return None
    path = os.path.abspath(os.fspath(path))
    if path != root and not path.startswith(root + os.sep):
        return None
    return os.path.relpath(path, root).replace(str(os.getpid()), "PID")


def _half_done(kind: str, real, args, kwargs, target: str) -> None:
    """What a crash in the middle of this call leaves behind (nothing, for the atomic ones)."""
    if kind in ("torch.save", "copyfile"):  # a file half written
        real(*args, **kwargs)
        with open(target, "r+b") as f:
            f.truncate(os.path.getsize(target) // 2)
    elif kind == "write":  # created, nothing written yet
        real(target, "w").close()
    elif kind == "rmtree":  # some files gone, the rest still there
        for folder, _, names in os.walk(target):
            if names:
                os.remove(os.path.join(folder, names[0]))
                return


def _raise(step: Step) -> None:
    raise InjectedFault(f"injected fault at: {step}")


@contextlib.contextmanager
def raises_injected():
    """The block fails because of the injected fault: raised as it is, or as the error every rank of a save raises
    for a failure on one of them (CheckpointSaveError), which carries the fault as its cause."""
    with pytest.raises(Exception) as info:
        yield info
    cause = info.value
    while cause is not None and not isinstance(cause, InjectedFault):
        cause = cause.__cause__
    assert cause is not None, f"the block failed for another reason than the injected fault: {info.value!r}"


def _writes(args, kwargs) -> bool:
    mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
    return any(flag in mode for flag in "wax+")


@contextlib.contextmanager
def watch(root, fail_at: Optional[int] = None, torn: bool = False,
          on_fault: Callable[[Step], None] = _raise):
    """Record (and optionally fail) the file-changing calls under `root`; yields the list of Steps seen so far."""
    root = os.path.abspath(os.fspath(root))
    steps: List[Step] = []
    busy = []  # non-empty while a watched call runs: what it calls itself is part of its step, not a step

    def wrap(kind, real, path_index, to_index):
        def wrapper(*args, **kwargs):
            path = _relative(root, args[path_index]) if len(args) > path_index and not busy else None
            if path is None or (kind == "write" and not _writes(args, kwargs)):
                return real(*args, **kwargs)
            step = Step(kind, path, _relative(root, args[to_index]) or "" if to_index is not None else "")
            steps.append(step)
            busy.append(step)
            try:
                if len(steps) - 1 == fail_at:
                    if torn:
                        _half_done(kind, real, args, kwargs, os.fspath(args[path_index]))
                    on_fault(step)
                return real(*args, **kwargs)
            finally:
                busy.pop()
        return wrapper

    originals = [(owner, name, getattr(owner, name)) for owner, name, *_ in WATCHED]
    for (owner, name, kind, path_index, to_index), (_, _, real) in zip(WATCHED, originals):
        setattr(owner, name, wrap(kind, real, path_index, to_index))
    try:
        yield steps
    finally:
        for owner, name, real in originals:
            setattr(owner, name, real)


def engine_state(engine) -> dict:
    """Everything a checkpoint restores to an engine: step count, learning rates, module weights, fp32 master
    partitions and every optimizer-state value (copies)."""
    opt = engine.optimizer
    state = {"global_steps": engine.global_steps, "lr": [g["lr"] for g in opt.param_groups]}
    state.update({f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()})
    for g, master in enumerate(opt.single_partition_of_fp32_groups):
        state[f"master.{g}"] = master.detach().clone()
        for key, value in opt.optimizer.state[master].items():
            state[f"state.{g}.{key}"] = value.detach().clone() if torch.is_tensor(value) else value
    return state


def differences(a: dict, b: dict) -> List[str]:
    """The keys of two engine_state()s that differ (tensors: in dtype or in any bit)."""
    def same(x, y):
        if torch.is_tensor(x) or torch.is_tensor(y):
            return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
        return x == y
    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not same(a[k], b[k])]
