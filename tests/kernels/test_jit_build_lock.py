"""A kernel build killed midway never hangs the next process (ops/loader.py, _build_lock).

torch's extension builder marks a build in progress with a `lock` file in its build folder, and every other process
waits for that file to go: forever, when its owner was killed. A JIT build of our kernels is started in a child with a
fresh TORCH_EXTENSIONS_DIR, killed (with its compiler) once torch's lock is there, and a second process then loads the
kernels: it removes the dead build's lock, says so, builds and passes the first-use check. Control: the kill left
torch's lock behind, and torch's own lock would not let anyone in (FileBaton refuses it).
"""

import glob
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, without_launch_vars
from support import process_tree

pytestmark = pytest.mark.slow

LOAD = ("import sys; from deepspeed_bnb.ops import loader, self_check; ok = loader.load(); "
        "print(loader.source(), loader.error()); "
        "sys.exit(0 if ok and self_check.disagreement('adam', 'cpu') is None else 1)")
STARTS_WITHIN = 600  # seconds for the killed child to get as far as torch's lock (imports, then the build starts)


def _torch_locks(folder: str) -> list:
    return glob.glob(os.path.join(folder, "*", "lock"))


def test_a_build_killed_midway_does_not_hang_the_next_one(tmp_path):
    folder = str(tmp_path / "extensions")
    env = dict(without_launch_vars(), TORCH_EXTENSIONS_DIR=folder)
    child = subprocess.Popen([sys.executable, "-c", LOAD], env=env, cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        waited = 0.0
        while not _torch_locks(folder):  # the build is under way once torch's lock is there
            assert child.poll() is None, "the build ended before it could be killed midway"
            assert waited < STARTS_WITHIN, "the build did not start"
            time.sleep(0.2)
            waited += 0.2
    finally:
        process_tree.kill_session(child)  # the child and its ninja and compilers
    stale = _torch_locks(folder)
    assert stale, "control: the killed build left torch's lock behind"
    # Without the suite's guard on JIT locks (tests/support/jit_guard.py): what a user's process has is the loader
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    control = subprocess.run([sys.executable, "-c", "import sys; from torch.utils.file_baton import FileBaton; "
                              "print(FileBaton(sys.argv[1]).try_acquire())", stale[0]], env=bare, capture_output=True,
                             text=True, timeout=600, check=True)
    assert control.stdout.strip() == "False", "control: torch's builder would wait on it"

    done = subprocess.run([sys.executable, "-W", "always", "-c", LOAD], env=bare, cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "jit None" in done.stdout.splitlines(), done.stdout  # built here, by the JIT
    assert f"removed {stale[0]}, the build lock of a kernel build that was killed" in done.stderr, done.stderr[-3000:]
    assert not _torch_locks(folder)
