"""A kernel build killed midway never hangs the next process (ops/loader.py, _build_lock).

torch's extension builder marks a build in progress with a `lock` file in its build folder, and every other process
waits for that file to go: forever, when its owner was killed. A JIT build of our kernels is started in a child with a
fresh TORCH_EXTENSIONS_DIR, killed (with its compiler) once torch's lock is there, and a second process then loads the
kernels: it removes the dead build's lock, says so, builds and passes the first-use check. Control: the kill left
torch's lock behind, and torch's own lock would not let anyone in (FileBaton refuses it). The processes run as one
fresh-process job beside the earlier tests (tests/support/killed_jit_build.py, tests/support/background.py).
"""

import sys

import pytest

from conftest import without_launch_vars
from support import background, killed_jit_build

pytestmark = pytest.mark.slow

# the timeout only ends a hang (the job bounds its own waits)
KILLED_BUILD = background.Job("killed_build", lambda folder: [sys.executable, killed_jit_build.__file__, folder],
                              without_launch_vars, timeout=2400)
BACKGROUND_JOBS = (KILLED_BUILD,)


@pytest.fixture(scope="module")
def killed_build():  # the job's name: a collected test using it starts the job early (background.start_for)
    return background.json_result(KILLED_BUILD, killed_jit_build.RESULT)


def test_a_build_killed_midway_does_not_hang_the_next_one(killed_build):
    killed = killed_build
    assert killed["started"] is True, killed["started"]
    stale = killed["stale"]
    assert stale, "control: the killed build left torch's lock behind"
    assert killed["control"] == "False", f"control: torch's builder would wait on it ({killed['control']})"
    load = killed["load"]
    assert load["returncode"] == 0, load["stdout"][-3000:] + load["stderr"][-3000:]
    assert "jit None" in load["stdout"].splitlines(), load["stdout"]  # built here, by the JIT
    assert f"removed {stale[0]}, the build lock of a kernel build that was killed" in load["stderr"], \
        load["stderr"][-3000:]
    assert killed["locks_after"] == []
