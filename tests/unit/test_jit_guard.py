"""No JIT build lock hangs the suite (tests/support/jit_guard.py): a lock whose builder died is taken over, and a
wait for a live builder is bounded.

- A lock its builder removes ends the wait; a lock a live process holds open is waited on, then a JitLockTimeout
  names it and its age (the lock stays: its builder may be slow, not dead); a builder that dies during the wait ends
  it with a JitBuilderDied; a lock no process holds open (its builder killed before) is removed with a warning naming
  it, and torch's FileBaton then acquires it (the process builds).
- End to end, with DeepSpeed's own op builder: a dead build's lock in its folder; a process with the guard (every
  child of the suite has it, through sitecustomize on the PYTHONPATH) loads the op and says it removed the lock.
  Control: a process without the guard still waits on that lock when its time is up.
"""

import os
import subprocess
import sys
import threading
import time
import types

import pytest

from conftest import GUARD_SITE, without_launch_vars
from support import jit_guard

HOLD = ("import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
        "time.sleep(60)")


FINISH = ("import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
          "sys.stdin.readline(); os.close(fd); os.remove(sys.argv[1])")


def test_a_lock_its_builder_removes_ends_the_wait(tmp_path):
    lock = tmp_path / "lock"
    builder = subprocess.Popen([sys.executable, "-c", FINISH, str(lock)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "held"
    threading.Timer(0.5, lambda: (builder.stdin.write("done\n"), builder.stdin.flush())).start()
    jit_guard.wait(str(lock), poll=0.05, limit=600)  # returns (no JitBuilderDied, no timeout)
    assert builder.wait(timeout=60) == 0 and not lock.exists()


def test_a_lock_held_open_by_a_live_process_is_waited_on_then_named(tmp_path):
    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert jit_guard.holders(str(lock)) == {holder.pid}
        with pytest.raises(jit_guard.JitLockTimeout, match=rf"waited 2 s on the JIT build lock {lock} \(created "
                                                           rf"\d+ s ago, held open by \[{holder.pid}\]\)"):
            jit_guard.wait(str(lock), poll=0.05, limit=2)
        assert lock.exists()  # its builder may be slow, not dead
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_no_process_holds_is_taken_over_with_a_warning(tmp_path):
    from torch.utils.file_baton import FileBaton
    lock = tmp_path / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # a builder that died: the file, no descriptor on it
    assert jit_guard.holders(str(lock)) == set()
    baton = FileBaton(str(lock))
    with pytest.warns(RuntimeWarning, match=rf"removed {lock}, a JIT build lock \d+ s old that no process holds"):
        assert baton.try_acquire()  # this process builds now
    assert jit_guard.holders(str(lock)) == {os.getpid()}
    baton.release()
    assert not lock.exists()


def test_taking_over_kills_what_the_dead_build_left_running_in_its_folder(tmp_path):
    """A compiler its dead builder's ninja started (a process working in the build folder) is killed with the take
    over; control: a process working elsewhere is left alone."""
    from torch.utils.file_baton import FileBaton
    folder, elsewhere = tmp_path / "build", tmp_path / "other"
    folder.mkdir(), elsewhere.mkdir()
    lock = folder / "lock"
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    leftover = subprocess.Popen(["sleep", "300"], cwd=folder)
    bystander = subprocess.Popen(["sleep", "300"], cwd=elsewhere)
    try:
        while jit_guard.working_in(str(folder)) != {leftover.pid}:  # until it has started (a busy machine)
            assert leftover.poll() is None
            time.sleep(0.05)
        with pytest.warns(RuntimeWarning, match=rf"killed what it left running there \(pids \[{leftover.pid}\]\)"):
            assert FileBaton(str(lock)).try_acquire()
        assert leftover.wait(timeout=60) == -9
        assert bystander.poll() is None  # control
    finally:
        for child in (leftover, bystander):
            child.kill()
            child.wait()


def test_a_builder_that_dies_during_the_wait_ends_it(tmp_path):
    lock = tmp_path / "lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    threading.Timer(1.0, holder.kill).start()  # killed mid-"build": its lock stays, held by no one
    with pytest.raises(jit_guard.JitBuilderDied, match=rf"the process building the extension of {lock} died"):
        jit_guard.wait(str(lock), poll=0.05, limit=60)
    holder.wait()
    assert not lock.exists()


def test_a_load_whose_builder_died_builds_in_this_process():
    """torch's `_jit_compile` patched: a first try whose wait ended with a JitBuilderDied is followed by a second,
    which builds (here: returns), with a warning; control: unpatched, the error reaches the caller."""
    died = jit_guard.JitBuilderDied("the process building the extension of x/lock died")

    def module():
        calls = []

        def _jit_compile(name):
            calls.append(name)
            if len(calls) == 1:
                raise died
            return f"built {name}"
        return types.SimpleNamespace(_jit_compile=_jit_compile, calls=calls)
    patched = module()
    jit_guard.patch_compile(patched)
    with pytest.warns(RuntimeWarning, match=r"died Building it in this process"):
        assert patched._jit_compile("op") == "built op"
    assert patched.calls == ["op", "op"]
    with pytest.raises(jit_guard.JitBuilderDied):  # control
        module()._jit_compile("op")


@pytest.mark.slow  # two fresh processes that import torch
def test_the_suite_and_its_children_have_the_guard():
    import torch.utils.cpp_extension
    from torch.utils.file_baton import FileBaton
    assert getattr(FileBaton.wait, "_bounded", False)  # this process (tests/conftest.py)
    assert getattr(torch.utils.cpp_extension._jit_compile, "_retrying", False)
    assert GUARD_SITE in os.environ["PYTHONPATH"].split(os.pathsep)
    probe = ("import sys, torch.utils.cpp_extension as c, torch.utils.file_baton as f; "
             "print(getattr(f.FileBaton.wait, '_bounded', False), getattr(c._jit_compile, '_retrying', False))")
    child = subprocess.run([sys.executable, "-c", probe], env=without_launch_vars(), capture_output=True, text=True,
                           check=True)
    assert child.stdout.strip() == "True True"
    # control: a child without the folder on its path keeps torch's own wait and build
    bare = {k: v for k, v in without_launch_vars().items() if k != "PYTHONPATH"}
    child = subprocess.run([sys.executable, "-c", probe], env=bare, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "False False"


LOAD_SHM = ("from deepspeed.accelerator import get_accelerator; "
            "builder = get_accelerator().create_op_builder('ShareMemCommBuilder'); print('loading', flush=True); "
            "builder.load(); print('loaded', flush=True)")


@pytest.mark.slow  # loads DeepSpeed's op in fresh processes
def test_deepspeeds_own_op_loads_past_a_dead_builders_lock(tmp_path):
    """DeepSpeed's CPU comm op (its builder, torch's FileBaton) with a dead build's lock in its folder: a process with
    the guard loads it and says it removed the lock; control: one without the guard is still waiting when its time is
    up. The op is built once in the suite's JIT folder and copied (a built folder loads without a rebuild)."""
    import shutil
    env = without_launch_vars()
    subprocess.run([sys.executable, "-c", LOAD_SHM], env=env, check=True, capture_output=True, timeout=1200)
    built = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "deepspeed_shm_comm")
    folder = tmp_path / "extensions"
    shutil.copytree(built, folder / "deepspeed_shm_comm", symlinks=True,
                    ignore=shutil.ignore_patterns("lock"))
    lock = folder / "deepspeed_shm_comm" / "lock"
    env = dict(env, TORCH_EXTENSIONS_DIR=str(folder))
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # what a build killed midway leaves
    # control: torch's own wait never ends (still waiting well after the child reached the load)
    control = subprocess.Popen([sys.executable, "-c", LOAD_SHM], env=bare, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    try:
        lines = iter(control.stdout.readline, "")  # DeepSpeed logs to stdout too
        assert any(line.strip() == "loading" for line in lines), "control: the child did not get to the load"
        with pytest.raises(subprocess.TimeoutExpired):
            control.wait(timeout=10)
    finally:
        control.kill()
        control.wait()
    done = subprocess.run([sys.executable, "-W", "always", "-c", LOAD_SHM], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"removed {lock}, a JIT build lock" in done.stderr, done.stderr[-2000:]
    assert not lock.exists()
