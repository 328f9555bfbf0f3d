"""Patches for client libraries (Accelerate), applied when and only when the client library itself is imported.

Accelerate and transformers are optional: `import deepspeed_bnb` never imports them. `install_lazily()` registers an
import hook that applies a client's patch right after the client's module has executed (or at once, if it was
imported before deepspeed_bnb). A client that is never imported is never touched.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# modules whose import installs their entries of the override register (overrides.py, `trigger`)
PATCHES = ("accelerate.accelerator",)


def _patch(module) -> None:
    from deepspeed_bnb.installer import install_triggered
    install_triggered(module.__name__, module)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds a patched module with the finders after it, and runs our patch once the module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1:]:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module  # a loader instance belongs to this one spec: wrapping it is local

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def install_lazily() -> None:
    """Patch clients already imported now, and the others when they are imported (idempotent)."""
    if importlib.util.find_spec("accelerate") is None:  # not installed: nothing to patch, no hook
        return
    for name in PATCHES:
        if name in sys.modules:
            _patch(sys.modules[name])
    if not any(isinstance(finder, _PatchAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())
