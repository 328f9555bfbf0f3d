"""Patches for client libraries (Accelerate), applied when and only when the client library itself is imported.

Accelerate and transformers are optional: `import deepspeed_bnb` never imports them. `install_lazily()` registers an
import hook that applies a client's patch right after the client's module has executed (or at once, if it was
imported before deepspeed_bnb). A client that is never imported is never touched.
"""

import importlib.util
import sys

from deepspeed_bnb.launch.after_import import RunAfterImport

# modules whose import installs their entries of the override register (overrides.py, `trigger`)
PATCHES = ("accelerate.accelerator",)


def _patch(module) -> None:
    from deepspeed_bnb.installer import install_triggered
    install_triggered(module.__name__, module)


def install_lazily() -> None:
    """Patch clients already imported now, and the others when they are imported (idempotent)."""
    if importlib.util.find_spec("accelerate") is None:  # not installed: nothing to patch, no hook
        return
    for name in PATCHES:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(finder, RunAfterImport) and finder.then is _patch for finder in sys.meta_path):
        sys.meta_path.insert(0, RunAfterImport(PATCHES, _patch))
