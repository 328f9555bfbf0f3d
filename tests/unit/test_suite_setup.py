"""The suite's own setup (conftest.py): the extras it needs are named when missing, and its markers select what they
say. Controls: a module that is there passes the check; a module without ranks is not marked multi_rank."""

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import conftest
from conftest import ROOT


def test_the_checked_modules_are_the_test_extra():
    with open(os.path.join(ROOT, "setup.py")) as f:
        extra = re.search(r'"test": \[([^\]]*)\]', f.read()).group(1)
    names = {re.split(r"[<>=!~\[; ]", item.strip().strip('"'))[0] for item in extra.split(",") if item.strip()}
    assert names - {"pytest"} == set(conftest.TEST_EXTRA)


def session(*args):
    """What pytest_sessionstart reads of a session started in the repository root with these arguments."""
    return SimpleNamespace(config=SimpleNamespace(invocation_params=SimpleNamespace(dir=ROOT), args=list(args)))


def test_a_missing_extra_is_named_with_the_fix(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    for args in (("tests",), (), ("tests", "tests/kernels/test_self_check.py")):
        with pytest.raises(pytest.UsageError, match=r"the test suite needs trl \(setup.py's `test` extra\): run "
                                                    r"`pip install -e \.\[test\]`"):
            conftest.pytest_sessionstart(session(*args))
    # named files only (the GPU proof's kernel tests on a machine without the extra): not held to it
    conftest.pytest_sessionstart(session("tests/kernels/test_self_check.py::test_x",
                                         "tests/kernels/test_fused_adam.py"))
    monkeypatch.setattr(importlib.util, "find_spec", real)
    conftest.pytest_sessionstart(session("tests"))  # control: all there, no error


def _collected(*args) -> int:
    done = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    found = re.search(r"(\d+)(?:/\d+)? tests? collected", done.stdout)
    assert found or "no tests collected" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    return int(found.group(1)) if found else 0


def test_markers_select_what_they_say():
    launches = os.path.join("tests", "distributed", "test_teardown.py")  # every test there launches ranks
    assert _collected("-m", "multi_rank", launches) > 0
    assert _collected("-m", "not multi_rank", launches) == 0
    no_ranks = os.path.join("tests", "unit", "test_state_layout.py")
    assert _collected("-m", "multi_rank", no_ranks) == 0  # control: no ranks
