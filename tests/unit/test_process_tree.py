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
