"""Killing a child started in a session of its own, with everything it started: its session, not its process group.

Why not the process group (os.killpg): ninja, behind every JIT build (torch.utils.cpp_extension: this project's
kernels and DeepSpeed's ops), runs each compiler command in a process group of its own. Killing the builder's group
kills the builder and ninja, while the compilers they started keep running as orphans and write their objects into
the build folder afterwards, beside the next build of the same extension (seen: three compilers of DeepSpeed's async_io
still running minutes after the GPU proof's rehearsal was killed). They all keep the session of the child started
with `start_new_session=True`, whose id is the child's pid; killing every process of that session leaves nothing.
Stdlib only: the GPU proof's parent process uses it before anything is installed. Linux (/proc); elsewhere the
process group is all that can be named.
"""

import os
import signal
import subprocess
import time
from typing import List


def session_members(sid: int) -> List[int]:
    """The pids of the live processes whose session id is `sid` (empty where /proc cannot be read)."""
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":  # a zombie is dead already
            found.append(pid)
    return found


def kill_session(child: subprocess.Popen) -> None:
    """SIGKILL `child` (started with start_new_session=True) and every process of its session, then reap it. Looks
    again until none is left: a process may fork while the first ones are killed, and a killed one is listed until
    it has exited (on a busy machine, a while after the signal); the deadline only ends a hang."""
    deadline = time.monotonic() + 120
    while True:
        members = session_members(child.pid) or ([child.pid] if child.poll() is None else [])
        if not members or time.monotonic() > deadline:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(child.pid, signal.SIGKILL)  # where /proc is missing: at least the group
        except ProcessLookupError:
            pass
        child.poll()
        time.sleep(0.01)
    child.wait()


def run(cmd, timeout: float, **popen) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own (Popen keywords `popen`: env, cwd, stdout, ...); past `timeout` seconds kill
    that session whole (kill_session). Its returncode is None when it was killed; stdout as Popen's pipes give it."""
    child = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        out, err = child.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, child.returncode, out, err)
    except subprocess.TimeoutExpired:
        kill_session(child)
        out, err = child.communicate()
        return subprocess.CompletedProcess(cmd, None, out, err)
