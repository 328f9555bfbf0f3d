"""No JIT build lock can hang the suite: a lock whose builder died is taken over, and every wait for a live one is
bounded.

Why: torch's extension builder (torch.utils.cpp_extension, behind every JIT build: this project's kernels and
DeepSpeed's own ops, async_io, cpu_adam, fused_adam, shm_comm, pin_memory among them) marks a build in progress with a
`lock` file in the build folder (torch.utils.file_baton.FileBaton), holds it open while it builds, and removes it after;
every other process that wants the same extension waits until the file is gone: forever, when the builder was killed
(a timeout, a deadline, Ctrl-C), since nothing else removes it. One such file once held a whole `make test` asleep.
`patch()` changes FileBaton for this process:
- try_acquire: a lock held open by no process (its builder is dead: a live one holds its descriptor from the file's
  creation until just before its removal), on two looks WAIT_POLL apart, is removed with a warning naming it and its
  age, what the dead build left running in its folder (compilers ninja started) is killed, and this process takes
  the build over;
- wait: at most `limit` seconds, then a JitLockTimeout naming the lock, its age and its holders; a builder that dies
  while this process waits ends the wait with a JitBuilderDied (torch would otherwise import a library that was never
  built);
- `patch_compile`: torch's `_jit_compile` then tries again, finds no lock and builds the extension in this process
  (a test waiting on a build the GPU proof's rehearsal was killed in now builds instead of failing).
Whether a process holds the file open is read from /proc/<pid>/fd (Linux); where that cannot be read for every
process, no lock counts as dead and only the bound applies.
The suite installs it in its own process (tests/conftest.py) and, through tests/support/site/sitecustomize.py on the
PYTHONPATH it hands on, in every child it starts (ranks, launchers, the GPU proof and its rehearsal); it takes
effect when a process imports torch's cpp_extension (or FileBaton), and imports nothing before.
"""

import importlib.abc
import importlib.util
import os
import signal
import sys
import time
import warnings

LIMIT_ENV = "DEEPSPEED_BNB_TEST_JIT_WAIT"  # seconds a wait may last (the children read it)
DEFAULT_LIMIT = 900.0  # a build of DeepSpeed's async_io on two busy cores takes minutes; no wait takes longer
WAIT_POLL = 0.5  # seconds between looks at the lock
BUILD_TRIES = 3  # loads of one extension in a process: the first, and after each builder that died while it waited


class JitLockTimeout(RuntimeError):
    """A wait for another process's JIT build outlasted the bound."""


class JitBuilderDied(RuntimeError):
    """The process building a JIT extension died while this one waited for it."""


def holders(path: str):
    """Processes that hold `path` open (a set of pids), or None when some process's descriptors cannot be read."""
    target = os.path.realpath(path)
    found = set()
    pids = _pids()
    if pids is None:
        return None
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue  # gone meanwhile
        except PermissionError:
            return None
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.add(int(pid))
            except OSError:
                continue
    return found


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def dead(lock: str, poll: float = WAIT_POLL) -> bool:
    """Whether `lock` exists and no process holds it open, on two looks `poll` seconds apart (a live builder closes
    its descriptor a moment before it removes the file)."""
    for look in range(2):
        if look:
            time.sleep(poll)
        if not os.path.exists(lock) or holders(lock) != set():
            return False
    return True


def _pids():
    """Every process's pid as /proc names it, or None where /proc cannot be listed."""
    try:
        return [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None


def working_in(folder: str):
    """Processes other than this one whose working folder is `folder` (a set of pids; empty without /proc)."""
    target = os.path.realpath(folder)
    found = set()
    for pid in _pids() or ():
        try:
            if int(pid) != os.getpid() and os.readlink(f"/proc/{pid}/cwd") == target:
                found.add(int(pid))
        except OSError:
            continue
    return found


def _kill_leftovers(lock: str) -> str:
    """Kill what a dead build left running in its folder; a clause naming them for the warning ("" if none).

    torch runs ninja in the build folder, and ninja gives each compiler a process group of its own: a builder killed
    by its process group (a timeout, a launcher stopping its ranks) dies with ninja, while its compilers keep running
    in that folder and write their objects after the next build has started on the same files. Once the lock is dead,
    whatever works in the folder is such a leftover (a live build would hold the lock open)."""
    left = working_in(os.path.dirname(lock))
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"; killed what it left running there (pids {sorted(left)})" if left else ""


def take_over(lock: str, poll: float = WAIT_POLL) -> bool:
    """Remove `lock` if its builder is dead (with a warning naming it, and killing what that build left running in
    its folder); whether it was removed."""
    if not dead(lock, poll):
        return False
    age = _age(lock)
    killed = _kill_leftovers(lock)
    try:
        os.remove(lock)
    except FileNotFoundError:
        return False
    warnings.warn(f"removed {lock}, a JIT build lock {age:.0f} s old that no process holds open: its builder died "
                  f"(killed mid-build){killed}; building again", RuntimeWarning, stacklevel=3)
    return True


def wait(lock: str, poll: float = WAIT_POLL, limit: float = DEFAULT_LIMIT) -> None:
    """Until `lock` is gone (its builder done); a JitBuilderDied when its builder dies meanwhile, a JitLockTimeout
    after `limit` seconds."""
    start = time.monotonic()
    while os.path.exists(lock):
        time.sleep(poll)
        if dead(lock, poll):
            age = _age(lock)
            killed = _kill_leftovers(lock)
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass
            raise JitBuilderDied(f"the process building the extension of {lock} died while this one waited for it "
                                 f"(the lock was {age:.0f} s old; removed now{killed}): the extension was not built. "
                                 f"Load it again: the next load builds it.")  # patch_compile does
        if time.monotonic() - start > limit:
            held = holders(lock)
            raise JitLockTimeout(f"waited {limit:.0f} s on the JIT build lock {lock} (created {_age(lock):.0f} s "
                                 f"ago, held open by {sorted(held) if held else 'no process we can see'}): another "
                                 f"build of that extension is still running or hung; if none is, remove the file")


def patch(file_baton, limit: float = None) -> None:
    """Change FileBaton of the module torch.utils.file_baton as the module docstring says (bounded by `limit`,
    default from LIMIT_ENV); once."""
    baton = file_baton.FileBaton
    if getattr(baton.wait, "_bounded", False):
        return
    bound = float(limit if limit is not None else os.environ.get(LIMIT_ENV, DEFAULT_LIMIT))
    acquire = baton.try_acquire

    def try_acquire(self):
        if acquire(self):
            return True
        return take_over(self.lock_file_path) and acquire(self)

    def bounded(self):
        wait(self.lock_file_path, max(self.wait_seconds, WAIT_POLL), bound)
    bounded._bounded = True
    baton.try_acquire = try_acquire
    baton.wait = bounded


def patch_compile(cpp_extension) -> None:
    """torch.utils.cpp_extension's `_jit_compile` (behind `load` and `load_inline`, DeepSpeed's builders and this
    project's loader) builds the extension itself when the build it waited for died: torch would only import a
    library that was never built, so the wait raises JitBuilderDied, and a second try then finds no lock and builds.
    Once."""
    compile_ = cpp_extension._jit_compile
    if getattr(compile_, "_retrying", False):
        return

    def retrying(*args, **kwargs):
        for attempt in range(BUILD_TRIES):
            try:
                return compile_(*args, **kwargs)
            except JitBuilderDied as exc:
                if attempt == BUILD_TRIES - 1:
                    raise
                warnings.warn(f"{exc} Building it in this process.", RuntimeWarning, stacklevel=2)
    retrying._retrying = True
    cpp_extension._jit_compile = retrying


PATCHES = {"torch.utils.file_baton": patch, "torch.utils.cpp_extension": patch_compile}  # module -> its patch


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES right after this process imports it (nothing is imported before then: a
    child's own imports, and what they cost, stay its own)."""

    def __init__(self, waiting: dict):
        self.waiting = dict(waiting)  # module name -> its patch, for the modules not imported yet

    def find_spec(self, name, path, target=None):
        apply = self.waiting.pop(name, None)
        if apply is None:
            return None
        if not self.waiting:
            sys.meta_path.remove(self)
        spec = _find_without(self, name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            apply(module)
        spec.loader.exec_module = exec_module
        return spec


def _find_without(finder, name):
    """The spec the other finders give `name` (this one stepped aside meanwhile)."""
    present = finder in sys.meta_path
    if present:
        sys.meta_path.remove(finder)
    try:
        return importlib.util.find_spec(name)
    finally:
        if present:
            sys.meta_path.insert(0, finder)


def install() -> None:
    """Apply PATCHES in this process: now to the modules torch has imported, to the others when it does."""
    pending = {name: apply for name, apply in PATCHES.items() if name not in sys.modules}
    for name, apply in PATCHES.items():
        if name in sys.modules:
            apply(sys.modules[name])
    if pending and not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(pending))
