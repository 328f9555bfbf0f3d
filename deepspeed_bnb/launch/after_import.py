"""An import hook that runs a function right after a named module has executed, found by the finders after it.

Standard library only: `deepspeed-bnb run`'s bootstrap (deepspeed_bnb/bootstrap/sitecustomize.py) loads this file by its
path at interpreter startup, before deepspeed_bnb may be imported; integrations/ uses it for Accelerate. (Not in the
bootstrap folder itself, which is on the wrapped processes' PYTHONPATH: it would be a top-level module there.)
"""

import importlib.abc
import sys
from typing import Callable, Iterable


class RunAfterImport(importlib.abc.MetaPathFinder):
    """For each module of `names`: find it with the finders after this one, and call `then(module)` once the module
    has executed. A spec found only to ask whether a module exists (`importlib.util.find_spec`, as libraries'
    availability checks do) is never executed, so the hook stays in place until the import itself happens."""

    def __init__(self, names: Iterable[str], then: Callable):
        self.names, self.then = frozenset(names), then

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
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

        def exec_then(module):
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_then
        return spec
