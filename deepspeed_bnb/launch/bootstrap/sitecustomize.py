"""Imported by Python at startup in every process `deepspeed-bnb run` starts (this folder is first on their
PYTHONPATH; deepspeed_bnb/launch/wrapper.py): activates deepspeed_bnb right after DeepSpeed is imported, then runs
the sitecustomize module this one shadows, if the environment has one.

Activation waits for DeepSpeed's own import (an import hook) so that processes which never import DeepSpeed (a
launcher's helpers, pip, a compiler) pay nothing. If deepspeed_bnb cannot be activated (an untested release, a broken
install), the import of DeepSpeed fails with the reason: a run that asked for deepspeed_bnb never goes on silently
with stock ZeRO. Python would only print an exception raised here at startup and carry on, so nothing is raised here.
Imports stay within the standard library: this runs before anything else in the process.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

RUN_ENV = "DEEPSPEED_BNB_RUN"  # deepspeed_bnb/launch/__init__.py (not imported: that would import deepspeed_bnb)
HERE = os.path.dirname(os.path.abspath(__file__))


def _activate() -> None:
    if os.environ.get("DEEPSPEED_BNB_OFFLINE") == "1":  # deepspeed-bnb's own offline tools: never activate
        return
    try:
        import deepspeed_bnb  # noqa: F401  (its import is the setup)
    except Exception as exc:
        raise ImportError(
            f"deepspeed-bnb run: deepspeed_bnb could not be activated in this process ({type(exc).__name__}: {exc}). "
            f"The run stops here rather than train with stock ZeRO, whose checkpoints of 8-bit state do not load at "
            f"another size. Fix the cause above, or run the command without `deepspeed-bnb run`.") from exc


class _ActivateAfterDeepSpeed(importlib.abc.MetaPathFinder):
    """Finds `deepspeed` with the finders after it and activates deepspeed_bnb once DeepSpeed's module has run.

    It stays in place until DeepSpeed is imported: libraries ask for DeepSpeed's spec without importing it
    (`importlib.util.find_spec("deepspeed")`, as transformers' and Accelerate's availability checks do), and a spec
    found for such a question is never executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "deepspeed":
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

        def exec_then_activate(module):
            exec_module(module)
            if self in sys.meta_path:  # DeepSpeed is imported: nothing left to watch for
                sys.meta_path.remove(self)
            _activate()

        spec.loader.exec_module = exec_then_activate
        return spec


def _chain() -> None:
    """Run the sitecustomize module that would have run without this folder on the path."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(RUN_ENV) == "1" and "deepspeed" not in sys.modules:
    sys.meta_path.insert(0, _ActivateAfterDeepSpeed())
_chain()
