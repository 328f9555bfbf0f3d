"""Ending a multi-rank job past gloo's teardown abort, and judging a launch that aborted anyway.

torch 2.13's gloo process group can kill a rank in C++ once the script is done ("terminate called without an active
exception", SIGABRT), even after destroy_process_group, with or without deepspeed_bnb (stock DeepSpeed with torch
AdamW does it in about 1 of 12 two-rank exits). The work is complete by then, but the launcher (torchrun, accelerate
launch, the deepspeed launcher) reports the job as failed. One rule for every launch of this repository:

- a rank ends with `finish()` once its results are written: it marks itself done (in the folder named by
  $RANKS_DONE_DIR, when its launcher set one), leaves the process group and exits 0 without the interpreter's
  teardown, where the abort happens;
- a launcher (`run_ranks`) accepts a failed launch only when every failure it reports is a SIGABRT AND every rank
  had marked itself done: an abort before a rank is done, or any other failure, still fails the launch.

`finish()` also removes the rank's shared-memory buffer of DeepSpeed's CPU comm op (`release_shm_buffer`): the op
creates a 66 MB `/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>` per rank and never unlinks it
(DeepSpeed 0.19.8's shm.cpp defines shared_close and never calls it), so every CPU launch left 66 MB of RAM per rank
behind: a day of test runs held 17 GB of a 24 GB machine.

It lives in the package because the examples, the benchmarks and the tests all launch ranks and all import it. The
module itself needs only the standard library (and torch.distributed when a rank finishes), but importing it runs the
package's __init__ (the release check, DeepSpeed's overrides): a process that must run stock DeepSpeed, or that may
lack DeepSpeed, imports it only where it is used.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional

DONE_DIR_VAR = "RANKS_DONE_DIR"  # the launcher's folder for the ranks' completion markers
ABORT = -signal.SIGABRT  # subprocess's returncode for a process killed by SIGABRT
# torchrun's (and accelerate launch's) report of a failed rank: "failed (exitcode: -6) local_rank: 1 ..." and,
# per failure, "exitcode  : -6 (pid: 123)  (SIGABRT)"
EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")


def mark_done(rank: int) -> None:
    """Record that this rank's results are written (a no-op outside a launch that asked for markers)."""
    folder = os.environ.get(DONE_DIR_VAR)
    if folder:
        with open(os.path.join(folder, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
            f.flush()
            os.fsync(f.fileno())


SHM_DIR = "/dev/shm"
SHM_BUFFER = "deepspeed_allreduce_buffer_{uid}_"  # DeepSpeed's CPU comm op's buffer names (this user's), then
# <addr>_<port>_<rank>


def release_shm_buffer(rank: int) -> None:
    """Unlink this rank's buffer of DeepSpeed's CPU comm op, named by the launch's MASTER_ADDR and MASTER_PORT (its
    peers have mapped it since their first collective, and a mapping outlives the name)."""
    name = SHM_BUFFER.format(uid=os.getuid()) + f"{os.environ.get('MASTER_ADDR', '')}_" \
        f"{os.environ.get('MASTER_PORT', '')}_{rank}"
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:  # none (another accelerator, no shm op, not a POSIX system): nothing was left behind
        pass


def sweep_shm_buffers(since: float) -> List[str]:
    """Unlink this user's comm-op buffers created at or after `since` (a time.time()) that no process maps: those of
    ranks that ended without finish() (killed by a signal or a timeout, or a script that never calls it). Returns
    their names. A buffer some process maps (a concurrent launch's) is kept; so is any created before `since`. The
    one window left: a concurrent launch's rank between creating its buffer and mapping it (a few system calls)."""
    prefix = SHM_BUFFER.format(uid=os.getuid())
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:  # no /dev/shm: nothing to sweep
        return []
    candidates = []
    for name in names:
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_mtime >= since:  # (a mapped write moves it later)
                candidates.append(name)
        except OSError:  # removed meanwhile
            continue
    if not candidates:
        return []
    mapped = _mapped_shm_names(prefix)
    removed = []
    for name in candidates:
        if name in mapped:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            continue
    return removed


def _mapped_shm_names(prefix: str) -> set:
    """The names under SHM_DIR starting with `prefix` that some process this user can inspect maps (/proc/*/maps)."""
    mapped = set()
    path = os.path.join(SHM_DIR, prefix)
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(path)
                    if at >= 0:
                        mapped.add(os.path.basename(line[at:].split()[0]))
        except OSError:  # gone, or another user's
            continue
    return mapped


def finish() -> None:
    """End this rank, its results written: mark it done, leave the process group, exit 0 at once. For a script's
    `__main__` block (it does not return)."""
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized():
        rank = tdist.get_rank()
        mark_done(rank)
        # every rank's collectives are over before any leaves (a rank gone early breaks a peer still in one)
        tdist.barrier()
        tdist.destroy_process_group()
        release_shm_buffer(rank)
    else:
        mark_done(int(os.environ.get("RANK", 0)))
    # the abort comes from the C++ objects the interpreter's teardown destroys; there is nothing left to do here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ranks_done(folder: str) -> List[int]:
    return sorted(int(name[4:]) for name in os.listdir(folder) if re.fullmatch(r"rank\d+", name))


def aborted_only(returncode: int, output: str) -> bool:
    """Whether the launch failed only by SIGABRT: the process itself (-6, or 134 through a shell), or a launcher
    reporting ranks that all died of it."""
    if returncode in (ABORT, 128 + signal.SIGABRT):
        return True
    codes = EXITCODE.findall(output)
    return bool(codes) and all(int(code) == ABORT for code in codes)


@dataclass
class Launch:
    cmd: List[str]
    returncode: int
    stdout: str
    stderr: str
    ranks: int
    done: List[int]  # the ranks that marked themselves done

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def aborted_after_done(self) -> bool:
        """Failed by SIGABRT alone, every rank done first: gloo's teardown abort, the results complete."""
        return self.returncode != 0 and self.done == list(range(self.ranks)) and \
            aborted_only(self.returncode, self.output)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 or self.aborted_after_done

    def failure(self, tail: int = 6000) -> str:
        """The command, its exit, and the end of its output; where the first Python traceback lies before that end,
        it too: the rank that failed first prints the cause, the others then fail on their broken connections."""
        first = self.output.find("Traceback (most recent call last)")
        cause = ""
        if 0 <= first < len(self.output) - tail:
            cause = f"the first traceback:\n{self.output[first:first + tail // 2]}\n...\nthe end of the output:\n"
        return (f"{' '.join(map(str, self.cmd))} exited with {self.returncode} (ranks done: {self.done} of "
                f"{self.ranks}):\n{cause}{self.output[-tail:]}")


PORT_TAKEN = re.compile(r"EADDRINUSE|[Aa]ddress already in use")
PORT_ARG = re.compile(r"^--master[_-]port=(\d+)$")
PORT_TRIES = 3


def unused_port() -> int:
    """A port the OS reports free now (another process can still take it before the launch binds it: run_ranks
    retries then)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(cmd, ranks: int, env: Optional[dict] = None, timeout: Optional[float] = None, cwd=None,
              log_path: Optional[str] = None) -> Launch:
    """Run a launch of `ranks` ranks that end with finish(); its output is captured, or written to `log_path`
    (and read back). `.ok` applies the rule above; nothing here raises for a failed launch. A launch with a
    `--master_port=N` argument that failed because the port was taken meanwhile (EADDRINUSE: a port picked free is
    not reserved) runs again on another port, PORT_TRIES times in all."""
    cmd = list(cmd)
    for attempt in range(PORT_TRIES):
        launch = _run_ranks_once(cmd, ranks, env, timeout, cwd, log_path)
        ports = [i for i, arg in enumerate(cmd) if PORT_ARG.match(str(arg))]
        if launch.ok or not ports or not PORT_TAKEN.search(launch.output) or attempt == PORT_TRIES - 1:
            return launch
        cmd[ports[0]] = f"{str(cmd[ports[0]]).split('=')[0]}={unused_port()}"
    return launch


def _run_ranks_once(cmd, ranks: int, env: Optional[dict], timeout: Optional[float], cwd,
                    log_path: Optional[str]) -> Launch:
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="ranks_done_") as folder:
        env[DONE_DIR_VAR] = folder
        if log_path:
            with open(log_path, "w") as log:
                done = subprocess.run(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                      timeout=timeout, check=False)
            with open(log_path) as log:
                done.stdout, done.stderr = log.read(), ""
        else:
            done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                                  check=False)
        return Launch(list(cmd), done.returncode, done.stdout, done.stderr, ranks, ranks_done(folder))
