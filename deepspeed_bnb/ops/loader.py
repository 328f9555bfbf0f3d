"""Loads the compiled operators: the prebuilt `deepspeed_bnb._C` if present, else a ninja JIT build of csrc/ (cached).

The JIT build compiles csrc/ops.cpp and the CPU kernels (plus the CUDA kernels when torch has CUDA) with
torch.utils.cpp_extension into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), once per source change and
per kind of CPU (its name carries a tag of the target -march=native resolves to here: see cpu_features.py), and per
candidate CUDA launch shape (DEEPSPEED_BNB_CUDA_SHAPE, build_flags.py: for measuring one; never the prebuilt build). A
prebuilt extension compiled for instruction sets this CPU lacks is refused (it would die with SIGILL), with a warning.
The sources are the checkout's csrc/ for an editable install, the package's own copy (deepspeed_bnb/csrc, put there by
setup.py) for one from a wheel. Without a compiler, ninja or the sources, load() says so and the ZeRO optimizer steps
with bitsandbytes' own update instead, after one warning.

A killed build never hangs the next one: torch's builder marks a build in progress with a `lock` file in the build
folder and every other process waits for it to go, forever if its owner was killed (elastic training kills ranks by
design; a cluster's home folder is shared). Our builds take an flock beside that folder first, which the kernel
releases when its holder dies; whoever holds it knows that a `lock` left inside is a dead build's, removes it with a
warning naming it, and builds (_build_lock).
"""

import contextlib
import importlib
import importlib.util
import os
import threading
import warnings
from typing import FrozenSet, Iterator, Optional

try:
    import fcntl
except ImportError:  # not POSIX: torch's own lock alone
    fcntl = None

import torch

from deepspeed_bnb.ops import cpu_features, fake
from deepspeed_bnb.ops.build_flags import (CPU_FLAGS, CPU_SOURCES, CUDA_SHAPE_ENV, CUDA_SOURCES, LINK_FLAGS, NVCC_FLAGS,
                                           OPERATORS, cuda_shape_flags, cuda_shape_tag)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the folder holding csrc/: the package itself when installed from a wheel (setup.py copies the sources in), the
# checkout for an editable install
_ROOT = _PACKAGE if os.path.isfile(os.path.join(_PACKAGE, "csrc", "ops.cpp")) else os.path.dirname(_PACKAGE)
CSRC = os.path.join(_ROOT, "csrc")
NAME = "deepspeed_bnb_ops"

_lock = threading.Lock()
# loaded: tried yet? error: why not; source: prebuilt/jit; needs: the instruction sets the loaded build may use
_state = {"loaded": None, "error": None, "source": None, "needs": None, "file": None}


def sources(cuda: bool):
    return [os.path.join(_ROOT, path) for path in CPU_SOURCES + (CUDA_SOURCES if cuda else [])]


def _has_op() -> bool:
    """Every operator the sources define is registered already (e.g. by a build the caller loaded itself)."""
    return hasattr(torch.ops, "deepspeed_bnb") and all(hasattr(torch.ops.deepspeed_bnb, op) for op in OPERATORS)



def _prebuilt_refusal() -> Optional[str]:
    """Why the prebuilt deepspeed_bnb._C must not be loaded on this CPU, or None (absent, or fit to run here)."""
    spec = importlib.util.find_spec("deepspeed_bnb._C")
    if spec is None or spec.origin is None:
        return None
    lacking = cpu_features.missing(cpu_features.read_needs(spec.origin) or ())
    if not lacking:
        return None
    return (f"the prebuilt {spec.origin} was compiled for instruction sets this CPU lacks ({', '.join(lacking)}; "
            f"listed in {cpu_features.ISA_FILE} beside it) and would die with SIGILL here; rebuild it on this machine, "
            f"or for any AVX2 CPU with DEEPSPEED_BNB_BUILD_EXT=1 DEEPSPEED_BNB_PORTABLE=1")


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Holds an flock on `<build_dir>.lock` (beside the folder torch's builder owns) for the whole build and load;
    under it, a torch `lock` file inside the folder was left by a build that died, and is removed. Without flock (some
    network file systems), a `lock` found there is named in a warning instead, with what to do."""
    stale = os.path.join(build_dir, "lock")
    with open(build_dir + ".lock", "a") as held:
        exclusive = fcntl is not None
        try:
            if exclusive:
                fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # waits for a live build; a dead one's is gone
        except OSError:
            exclusive = False
        if os.path.exists(stale):
            if exclusive:
                os.remove(stale)
                warnings.warn(f"deepspeed_bnb: removed {stale}, the build lock of a kernel build that was killed "
                              f"(torch's builder would have waited on it forever); building again.", RuntimeWarning,
                              stacklevel=5)
            else:
                warnings.warn(f"deepspeed_bnb: {stale} marks a kernel build in progress, and this file system gives "
                              f"no flock to tell whether its owner is alive; if no build is running, remove that "
                              f"file, or this process waits on it.", RuntimeWarning, stacklevel=5)
        yield


def _build(verbose: bool) -> str:
    refused = _prebuilt_refusal()
    cuda = torch.version.cuda is not None and torch.cuda.is_available()
    shape = os.environ.get(CUDA_SHAPE_ENV, "")
    shape_flags = cuda_shape_flags(shape)  # checked everywhere; it shapes CUDA kernels only
    shape_flags = shape_flags if cuda else []
    if refused is None and not shape_flags:  # a candidate shape is a build of its own, never the prebuilt one
        try:
            module = importlib.import_module("deepspeed_bnb._C")  # prebuilt by setup.py (DEEPSPEED_BNB_BUILD_EXT=1)
            _state["needs"] = cpu_features.read_needs(module.__file__)
            _state["file"] = module.__file__
            return "prebuilt"
        except ImportError:
            pass
    if not os.path.isfile(os.path.join(CSRC, "ops.cpp")):
        raise FileNotFoundError((refused + "; and " if refused else "") +
                                f"the C++ sources are neither in the package ({os.path.join(_PACKAGE, 'csrc')}, "
                                f"where a wheel of deepspeed_bnb puts them) nor in a checkout beside it ({CSRC}); "
                                f"reinstall the package (pip install deepspeed_bnb, or . from a checkout)")
    from torch.utils.cpp_extension import load, verify_ninja_availability
    verify_ninja_availability()
    # one cached build per kind of CPU: a shared TORCH_EXTENSIONS_DIR must not hand this CPU another CPU's build
    macros = cpu_features.compiler_macros(CPU_FLAGS)
    tag = cpu_features.build_tag(macros)
    from torch.utils.cpp_extension import _get_build_directory  # torch's own choice of folder (and its creation)
    name = f"{NAME}{'_cuda' if cuda else ''}_{tag}" + (f"_{cuda_shape_tag(shape)}" if shape_flags else "")
    build_dir = _get_build_directory(name, verbose)
    with _build_lock(build_dir):
        load(name=name, sources=sources(cuda), extra_include_paths=[os.path.join(CSRC, "include")],
             extra_cflags=CPU_FLAGS, extra_cuda_cflags=NVCC_FLAGS + shape_flags, extra_ldflags=LINK_FLAGS,
             is_python_module=False, build_directory=build_dir, verbose=verbose)
    _state["needs"] = cpu_features.needs_of(macros)
    _state["file"] = os.path.join(build_dir, f"{name}.so")
    if refused:
        warnings.warn(f"deepspeed_bnb: {refused}. JIT-compiled the kernels for this CPU instead.", RuntimeWarning,
                      stacklevel=4)
    return "jit"


def load(verbose: bool = False) -> bool:
    """Make torch.ops.deepspeed_bnb.* available; False when they cannot be built here (error() says why; the
    caller decides what runs instead and says so)."""
    with _lock:
        if _state["loaded"] is None:
            try:
                _state["source"] = "already registered" if _has_op() else _build(verbose)
                fake.register(OPERATORS)  # the shape-only implementations beside the compiled ones
                _state["loaded"] = True
            except Exception as exc:  # compiler, ninja, sources: any of them missing means no kernel here
                _state["loaded"], _state["error"] = False, f"{type(exc).__name__}: {exc}"
        return _state["loaded"]


def require():
    """torch.ops.deepspeed_bnb, loaded; a RuntimeError saying why when it cannot be (never a silent substitute)."""
    if not load():
        raise RuntimeError(f"deepspeed_bnb: the fused kernels could not be built or loaded here: {error()}")
    return torch.ops.deepspeed_bnb


def error() -> Optional[str]:
    return _state["error"]


def compiled_for() -> Optional[FrozenSet[str]]:
    """The instruction sets (/proc/cpuinfo names) the loaded build may use: the prebuilt one's record, or what
    -march=native enabled for the JIT build; None when not loaded (or a prebuilt build without its record)."""
    return _state["needs"]


def built_file() -> Optional[str]:
    """The shared library holding the loaded operators (None when they are not loaded, or were registered before)."""
    return _state.get("file")


def source() -> Optional[str]:
    """Where the operators came from: "prebuilt", "jit" or "already registered" (None: not loaded)."""
    return _state["source"]
