"""The repository's Python source files, for the tests that read code instead of running it (layering, patches,
compatibility calls, the suite's own layout)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "deepspeed_bnb")


def python_files(folder: str = PACKAGE) -> list:
    """Every .py file under `folder`, sorted."""
    return sorted(os.path.join(where, name) for where, _, names in os.walk(folder) for name in names
                  if name.endswith(".py"))
