"""Imported by Python at startup in every process `deepspeed-bnb run` starts (this folder is first on their
PYTHONPATH; deepspeed_bnb/launch/wrapper.py): activates deepspeed_bnb right after DeepSpeed is imported, then runs
the sitecustomize module this one shadows, if the environment has one.

Activation waits for DeepSpeed's own import (an import hook) so that processes which never import DeepSpeed (a
launcher's helpers, pip, a compiler) pay nothing. If deepspeed_bnb cannot be activated (an untested release, a broken
install), the import of DeepSpeed fails with the reason: a run that asked for deepspeed_bnb never goes on silently
with stock ZeRO. Python would only print an exception raised here at startup and carry on, so nothing is raised here.
Imports stay within the standard library: this runs before anything else in the process.
"""

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


def _hook():
    """launch/after_import.py's RunAfterImport, loaded by its path: importing it by name would import deepspeed_bnb."""
    path = os.path.join(os.path.dirname(HERE), "launch", "after_import.py")
    spec = importlib.util.spec_from_file_location("_deepspeed_bnb_after_import", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RunAfterImport


def _on_deepspeed(module) -> None:
    """DeepSpeed is imported: nothing left to watch for; activate."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if getattr(finder, "then", None) is not _on_deepspeed]
    _activate()


def _chain() -> None:
    """Run the sitecustomize module that would have run without this folder on the path."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(RUN_ENV) == "1" and "deepspeed" not in sys.modules:
    # it stays until DeepSpeed is imported: transformers and Accelerate ask for DeepSpeed's spec first, without
    # executing it (their availability checks), and a hook removed then would never see the import
    sys.meta_path.insert(0, _hook()(["deepspeed"], _on_deepspeed))
_chain()
