"""Killing a child's session kills what it started in process groups of their own, as ninja starts each compiler
(tests/support/process_tree.py); control: killing the child's process group leaves them running."""

import os
import signal
import subprocess
import time

import pytest

from support import process_tree

pytestmark = pytest.mark.slow  # starts processes of its own
# a child that starts three grandchildren, each in a process group of its own (bash's job control: `set -m`)
CHILD = ["bash", "-c", "set -m; sleep 300 & sleep 300 & sleep 300 & wait"]


def _started() -> subprocess.Popen:
    child = subprocess.Popen(CHILD, start_new_session=True)
    deadline = time.monotonic() + 600  # a hang guard only: on a busy machine the children may take a while
    while len(process_tree.session_members(child.pid)) < 4:
        assert time.monotonic() < deadline, "the grandchildren did not start"
        time.sleep(0.05)
    return child


def _groups(pids) -> set:
    return {os.getpgid(pid) for pid in pids}


def test_killing_the_session_leaves_nothing():
    child = _started()
    members = process_tree.session_members(child.pid)
    assert len(_groups(members)) == 4  # the child's group and one per grandchild
    process_tree.kill_session(child)
    assert process_tree.session_members(child.pid) == []
    assert child.returncode == -signal.SIGKILL


def test_control_killing_the_process_group_leaves_the_grandchildren():
    child = _started()
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    left = process_tree.session_members(child.pid)
    try:
        assert len(left) == 3, left
    finally:
        for pid in left:
            os.kill(pid, signal.SIGKILL)


def test_run_past_its_timeout_kills_the_session_and_says_so():
    """process_tree.run: a command still running at its timeout comes back with returncode None, its grandchildren
    killed too (their output pipe closes: without that, reading it would wait for them); control: one that finishes
    gives its exit code and output."""
    done = process_tree.run(CHILD, 1, stdout=subprocess.PIPE, text=True)
    assert done.returncode is None
    finished = process_tree.run(["bash", "-c", "echo ran; exit 3"], 600, stdout=subprocess.PIPE, text=True)
    assert (finished.returncode, finished.stdout) == (3, "ran\n")
