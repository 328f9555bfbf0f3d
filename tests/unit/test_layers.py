"""The package's layers do not leak: what each part imports, and what importing the package does.

- `import deepspeed_bnb` does not import bitsandbytes (about 2 s per rank): a process whose optimizer is not a bnb one
  never pays for it; a bnb optimizer still routes (its module is loaded by then).
- The offline tools (deepspeed_bnb/checkpoint/) import neither the bnb driver (optim/bnb_adapter.py) nor the DeepSpeed
  patches (runtime/), nor bitsandbytes, at module level.
- Only deepspeed_bnb/__init__.py changes anything at import time (DeepSpeed's classes, other modules' attributes);
  installing twice changes nothing (the originals kept are DeepSpeed's own).
Controls: the same checks flag a process that did import bitsandbytes, and a module that does import the runtime.
"""

import ast
import os
import subprocess
import sys

import pytest

from conftest import TESTS, without_launch_vars
from support.sources import python_files

PACKAGE = os.path.join(os.path.dirname(TESTS), "deepspeed_bnb")


def _modules_loaded_after(code: str) -> set:
    done = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                          capture_output=True, text=True, env=without_launch_vars(), check=True)
    return set(done.stdout.split())


@pytest.mark.slow  # imports the package in a fresh process
def test_import_does_not_load_bitsandbytes():
    loaded = _modules_loaded_after("import deepspeed_bnb")
    assert "deepspeed_bnb.runtime.zero.stage_1_and_2" in loaded
    assert not {m for m in loaded if m.split(".")[0] == "bitsandbytes"}
    control = _modules_loaded_after("import bitsandbytes, deepspeed_bnb")
    assert "bitsandbytes.optim.optimizer" in control


def _module_level_imports(path: str) -> set:
    """Modules a file imports when it is imported (not inside functions; TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(open(path).read())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            continue
        for child in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
    return found


def _package_files(*parts):
    return python_files(os.path.join(PACKAGE, *parts))


FORBIDDEN_FOR_TOOLS = ("deepspeed_bnb.optim.bnb_adapter", "deepspeed_bnb.runtime", "bitsandbytes")


def _forbidden(path):
    return sorted(m for m in _module_level_imports(path) if m.startswith(FORBIDDEN_FOR_TOOLS))


@pytest.mark.parametrize("path", _package_files("checkpoint"), ids=os.path.basename)
def test_offline_tools_import_no_driver_and_no_patches(path):
    assert _forbidden(path) == []


def test_control_import_scan_sees_runtime_imports():
    assert _forbidden(os.path.join(PACKAGE, "runtime", "engine.py"))


def _import_time_effects(path: str) -> list:
    """Statements that do something when the module is imported: calls, and assignments to another object's
    attribute (a patch)."""
    effects = []
    body = list(ast.parse(open(path).read()).body)
    for node in body:
        if isinstance(node, ast.If) and "__main__" not in ast.unparse(node.test):  # a condition hides nothing
            body += node.body + node.orelse
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            effects.append(ast.unparse(node))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            effects += [ast.unparse(node) for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))]
    return effects


# Python runs it at startup, as `sitecustomize`, in the processes `deepspeed-bnb run` starts (its folder first on their
# PYTHONPATH); nothing in the package imports it
STARTUP_HOOK = os.path.join(PACKAGE, "bootstrap", "sitecustomize.py")


def test_only_the_package_init_changes_anything_at_import():
    for path in _package_files():
        if os.path.basename(path) in ("__init__.py", "__main__.py") and os.path.dirname(path) == PACKAGE:
            continue
        if path == STARTUP_HOOK:
            continue
        assert _import_time_effects(path) == [], path
    assert _import_time_effects(STARTUP_HOOK), "control: the startup hook installs its import hook"
    assert not any("bootstrap.sitecustomize" in open(path).read() or "bootstrap import" in open(path).read()
                   for path in _package_files()), "the startup hook is imported by the package"
    assert _import_time_effects(os.path.join(PACKAGE, "__init__.py")), "control: __init__ installs the hooks"


def test_installing_twice_keeps_deepspeeds_originals():
    import deepspeed.runtime.engine as ds_engine
    import deepspeed.runtime.zero.config as ds_zero_config

    from deepspeed_bnb import installer
    from deepspeed_bnb.runtime import engine
    from deepspeed_bnb.runtime.zero import config
    installer.activate()
    installer.activate()
    assert set(installer._STOCK) >= {o.key for o in installer.installed_entries()}
    for name, original in installer._STOCK.items():
        assert original.__module__.startswith(("deepspeed.", "accelerate.")), (name, original.__module__)
    assert ds_engine.DeepSpeedEngine._configure_zero_optimizer is engine._configure_zero_optimizer
    assert ds_zero_config.DeepSpeedZeroConfig is config.BnbZeroConfig
    assert config.BnbZeroConfig.__mro__[1].__module__ == "deepspeed.runtime.zero.config"
