"""The example scripts a test drives in-process (examples/train_*.py, elastic_failover.py), loaded from their files.

examples/ is never put on sys.path: what the examples share with the tests and benchmarks lives in the package
(deepspeed_bnb.demo, deepspeed_bnb.utils.teardown). A script under test is loaded here as a module of its own name,
registered in sys.modules, so that a script importing another example (train_trl_sft.py imports train_hf_trainer.py,
which it finds beside itself when run) gets the one loaded here: load that one first.
"""

import importlib.util
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def load(name: str):
    """examples/<name>.py as the module `name` (once per process), without running its `__main__` part."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
