"""Fresh-process jobs that start once collection is done and run one after another beside the in-process tests.

Why: on 2 cores the in-process tests keep about one core busy (`make test-quick`: 95 s of CPU in 94 s of wall time),
while the suite's largest single jobs (the GPU proof's rehearsal, the benchmarks' smoke runs) are fresh processes
whose results only a few tests read. Started early, such a job runs while the tests collected before its own still
run, and its fixture then waits for it. One job at a time, so the suite never asks for more than about one core
beyond what its foreground test uses. A job nobody started early (its module run alone, `-k`) starts when its fixture
asks for it; nothing starts for `--collect-only`.

A test module declares its jobs as `BACKGROUND_JOBS = (Job(...), ...)`; a job starts early when a collected test uses
the fixture of its name. Each job gets a folder of its own (removed at the session's end), its environment is read
when it is queued (in the main thread: a test's monkeypatched environment never leaks into it), and its timeout only
guards against a hang (it kills the job's whole session: support/process_tree.py): a busy machine makes it slower,
never failed.
"""

import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from support import process_tree


@dataclass(frozen=True)
class Job:
    name: str  # the fixture that reads its result (a test using that fixture starts the job early)
    command: Callable[[str], List[str]]  # the argv, given the job's own folder
    env: Callable[[], dict]  # its environment, read when it is queued
    timeout: float  # seconds before its whole session is killed: a hang guard, not a bar


@dataclass
class Done:
    returncode: Optional[int]  # None: killed at its timeout
    stdout: str
    stderr: str
    folder: str  # the job's own folder (removed when the session ends)
    seconds: float  # wall time it ran
    began: float = 0.0  # when it started, in seconds after the queue's first job was queued


@dataclass
class _Entry:
    job: Job
    argv: List[str]
    env: dict
    folder: str
    finished: threading.Event
    done: Optional[Done] = None


class _Queue:
    def __init__(self):
        self._entries: Dict[str, _Entry] = {}
        self._pending: List[str] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._running: Optional[subprocess.Popen] = None
        self._stopped = False
        self._epoch: Optional[float] = None  # when the first job was queued (the report's time origin)

    def queue(self, jobs: Sequence[Job]) -> None:
        with self._lock:
            if self._epoch is None:
                self._epoch = time.monotonic()
            for job in jobs:
                if job.name in self._entries:
                    continue
                folder = tempfile.mkdtemp(prefix=f"dsbnb_{job.name}_")
                self._entries[job.name] = _Entry(job, job.command(folder), job.env(), folder, threading.Event())
                self._pending.append(job.name)
            if self._pending and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._work, name="background-jobs", daemon=True)
                self._thread.start()

    def result(self, job: Job) -> Done:
        self.queue([job])
        entry = self._entries[job.name]
        entry.finished.wait()
        return entry.done

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._pending or self._stopped:
                    return
                entry = self._entries[self._pending.pop(0)]
                child = subprocess.Popen(entry.argv, env=entry.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, start_new_session=True)  # its own session: killed whole
                self._running = child
            began = time.monotonic()
            try:
                out, err = child.communicate(timeout=entry.job.timeout)
                code = child.returncode
            except subprocess.TimeoutExpired:
                process_tree.kill_session(child)
                out, err = child.communicate()
                code = None
            with self._lock:
                self._running = None
            entry.done = Done(code, out, err, entry.folder, time.monotonic() - began, began - self._epoch)
            entry.finished.set()

    def report(self) -> List[str]:
        """One line per job: when it started and how long it ran (whether the queue, not the tests, sets the
        suite's wall time), or that it never ran."""
        lines = []
        for name, entry in self._entries.items():
            done = entry.done
            if done is None or (done.returncode is None and not done.seconds):
                lines.append(f"{name}: did not run")
            else:
                lines.append(f"{name}: started at {done.began:.0f} s, ran {done.seconds:.0f} s"
                             + ("" if done.returncode is not None else " (killed at its timeout)"))
        return lines

    def stop(self) -> None:
        """Kill what runs, drop what waits, remove every job's folder (the session is over)."""
        with self._lock:
            self._stopped = True
            self._pending.clear()
            running = self._running
        if running is not None:
            process_tree.kill_session(running)
        if self._thread is not None:
            self._thread.join(timeout=60)
        for entry in self._entries.values():
            if entry.done is None:
                entry.done = Done(None, "", "the session ended before the job finished", entry.folder, 0.0)
                entry.finished.set()
            shutil.rmtree(entry.folder, ignore_errors=True)


_QUEUE = _Queue()


def unnamed_jobs(module) -> List[str]:
    """The jobs of a test module that no fixture of the module is named after: nothing would start them early, and the
    tests reading them would wait for the whole job when they ask (silently slower, never failed)."""
    return [f"{module.__name__}: background job {job.name!r} has no fixture of its name in the module"
            for job in getattr(module, "BACKGROUND_JOBS", ()) if not callable(getattr(module, job.name, None))]


def start_for(items) -> None:
    """Queue, in collection order, the jobs of the collected tests' modules whose fixtures those tests use; a
    ValueError where a module declares a job no fixture is named after."""
    jobs, seen = [], set()
    modules = list(dict.fromkeys(getattr(item, "module", None) for item in items))
    problems = [problem for module in modules if module is not None for problem in unnamed_jobs(module)]
    if problems:
        raise ValueError("; ".join(problems) + " (name the fixture that reads a job's result after the job)")
    for item in items:
        module = getattr(item, "module", None)
        for job in getattr(module, "BACKGROUND_JOBS", ()):
            if job.name not in seen and job.name in getattr(item, "fixturenames", ()):
                seen.add(job.name)
                jobs.append(job)
    if jobs:
        _QUEUE.queue(jobs)


def result(job: Job) -> Done:
    """The job's outcome, waiting for it (queued now if nothing queued it before)."""
    return _QUEUE.result(job)


def json_result(job: Job, *path: str, tail: int = 6000):
    """What the job wrote as JSON at `path` in its folder, once it succeeded (else the test fails with the end of its
    output)."""
    import json
    import os
    done = result(job)
    assert done.returncode == 0, (done.stdout + done.stderr)[-tail:]
    with open(os.path.join(done.folder, *path)) as f:
        return json.load(f)


def report() -> List[str]:
    return _QUEUE.report()


def stop() -> None:
    _QUEUE.stop()
