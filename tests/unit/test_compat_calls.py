"""DeepSpeed functions that the oldest supported release lacks are called through runtime/zero/compat.py only.

`deepspeed.comm.all_gather_object` exists from DeepSpeed 0.17.0 on; a direct call elsewhere works on the release the
suite runs and fails on 0.16.x (it did: the universal-checkpoint load into a model-parallel engine, found by running
the model-parallel tests on 0.16.4). Read from the package's source; control: a planted direct call is found.
"""

import ast
import os

from support.sources import PACKAGE, python_files

COMPAT = os.path.join(PACKAGE, "runtime", "zero", "compat.py")
NEWER_THAN_OLDEST = ("all_gather_object",)  # deepspeed.comm functions added after 0.16.4


def direct_calls(source: str):
    """`dist.<name>` / `deepspeed.comm.<name>` uses of NEWER_THAN_OLDEST names in `source`: their line numbers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in NEWER_THAN_OLDEST:
            owner = ast.unparse(node.value)
            if owner in ("dist", "deepspeed.comm", "comm"):
                found.append(node.lineno)
    return found


def test_no_module_but_compat_calls_them_directly():
    offenders = {}
    for path in python_files(PACKAGE):
        if path != COMPAT:
            with open(path) as f:
                lines = direct_calls(f.read())
            if lines:
                offenders[os.path.relpath(path, PACKAGE)] = lines
    assert offenders == {}, f"call these through runtime/zero/compat.py: {offenders}"


def test_control_a_direct_call_is_found():
    assert direct_calls("from deepspeed import comm as dist\ndist.all_gather_object(a, b)\n") == [2]
    assert direct_calls("compat.all_gather_object(a, b)\n") == []
