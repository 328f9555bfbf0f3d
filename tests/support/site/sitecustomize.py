"""Run at the start of every Python process whose PYTHONPATH holds this folder (the test suite puts it there for the
children it starts): torch's wait for a JIT build lock becomes bounded and aware of dead builders when the process
imports it (tests/support/jit_guard.py, loaded by its path under a name of its own). Never fails a process: on any
error it does nothing."""

try:
    import importlib.util
    import os
    import sys

    _GUARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jit_guard.py")
    _spec = importlib.util.spec_from_file_location("_deepspeed_bnb_tests_jit_guard", _GUARD)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module
    _spec.loader.exec_module(_module)
    _module.install()
except Exception:  # an unexpected interpreter or layout: run the child as it is
    pass
