"""The rule every multi-rank launch of the repository is judged by (deepspeed_bnb/utils/teardown.py).

torch 2.13's gloo group can abort a finished rank in C++ (SIGABRT, "terminate called without an active exception")
after its results are written; the launch then fails although nothing is missing. A launch passes when it exits 0,
or when it failed by SIGABRT alone after every rank had marked itself done (teardown.finish()). Real torchrun launches
of tests/support/teardown_worker.py: the abort after the results is accepted; the same abort before a rank's result, or
another failure after it, is not (negative controls). No timing is involved: the outcome of each launch is fixed by
what its ranks do.
"""

import os
import signal
import sys

import pytest
from conftest import TESTS, free_port, launch_env

from deepspeed_bnb.utils.teardown import DONE_DIR_VAR, aborted_only, run_ranks

pytestmark = pytest.mark.multi_rank


def launch(out, mode, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(TESTS, "support", "teardown_worker.py"), str(out), mode]
    return run_ranks(cmd, 2, env={**launch_env(), **env}, timeout=300)


def results(out):
    return sorted(name for name in os.listdir(out) if name.startswith("result"))


def test_a_clean_end_exits_0(tmp_path):
    done = launch(tmp_path, "clean")
    assert (done.returncode, done.done, done.ok) == (0, [0, 1], True), done.failure()
    assert results(tmp_path) == ["result0", "result1"]


def test_an_abort_after_every_result_is_accepted(tmp_path):
    done = launch(tmp_path, "abort_after")
    assert done.returncode != 0 and "SIGABRT" in done.output, done.failure()  # the launcher did report a failure
    assert done.done == [0, 1] and done.aborted_after_done and done.ok, done.failure()
    assert results(tmp_path) == ["result0", "result1"]


def test_an_abort_before_a_result_fails_the_launch(tmp_path):
    """Negative control: the same SIGABRT, before rank 1 wrote anything."""
    done = launch(tmp_path, "abort_before")
    assert done.returncode != 0 and 1 not in done.done, done.failure()
    assert not done.aborted_after_done and not done.ok
    assert "result1" not in results(tmp_path)


def test_another_failure_after_every_result_fails_the_launch(tmp_path):
    """Negative control: every rank done, but one exits 3 rather than by SIGABRT."""
    done = launch(tmp_path, "error_after")
    assert done.returncode != 0 and done.done == [0, 1], done.failure()
    assert not done.aborted_after_done and not done.ok


@pytest.mark.parametrize("marks_done, ok", [(True, True), (False, False)])
def test_a_single_process_killed_by_sigabrt(marks_done, ok):
    """Without a launcher in between (returncode -6): accepted only after the process marked itself done."""
    code = ("import os; from deepspeed_bnb.utils import teardown; "
            f"{'teardown.mark_done(0); ' if marks_done else ''}os.abort()")
    done = run_ranks([sys.executable, "-c", code], 1, env=launch_env(), timeout=60)
    assert done.returncode == -signal.SIGABRT and done.done == ([0] if marks_done else [])
    assert done.ok is ok


REPORT = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 123)  (SIGABRT)
"""


@pytest.mark.parametrize("returncode, output, expected", [
    (-6, "", True), (134, "", True),  # the process itself; through a shell
    (1, "failed (exitcode: -6) local_rank: 1\n" + REPORT.format(code=-6), True),  # torchrun's report
    (1, REPORT.format(code=-6) + "Failures:\n[1]:\n  exitcode  : 1 (pid: 124)\n", False),  # and another failure
    (1, REPORT.format(code=1), False),
    (1, "Traceback (most recent call last):\nRuntimeError: boom\n", False),  # no report at all
    (-9, "", False), (-15, "", False),
])
def test_what_counts_as_an_abort(returncode, output, expected):
    assert aborted_only(returncode, output) is expected


def test_a_launch_that_asked_for_no_markers_marks_nothing(tmp_path, monkeypatch):
    from deepspeed_bnb.utils.teardown import mark_done
    monkeypatch.delenv(DONE_DIR_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    mark_done(0)
    assert os.listdir(tmp_path) == []


BINDS_ITS_PORT = ("import socket, sys; port = int(sys.argv[1].split('=')[1]); s = socket.socket(); "
                  "s.bind(('127.0.0.1', port)); print('bound', port)")


def test_a_launch_whose_port_was_taken_meanwhile_runs_again_on_another():
    """A port picked free is not reserved: when another process takes it first, the launch fails with EADDRINUSE and
    run_ranks runs it again on a fresh port. Control: the same command without a --master_port argument is not
    retried, and fails."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = run_ranks([sys.executable, "-c", BINDS_ITS_PORT, f"--master_port={port}"], 0, timeout=120)
        assert launch.ok, launch.failure()
        assert "bound" in launch.stdout and f"bound {port}" not in launch.stdout
        assert launch.cmd[-1] != f"--master_port={port}"
        plain = run_ranks([sys.executable, "-c", BINDS_ITS_PORT.replace("sys.argv[1].split('=')[1]", "sys.argv[1]"),
                           str(port)], 0, timeout=120)
        assert not plain.ok and "Address already in use" in plain.output


def shm_buffers(port):
    """DeepSpeed's CPU comm op buffers of a launch on `port` left in /dev/shm."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_")
                  and f"_127.0.0.1_{port}_" in n)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm: DeepSpeed's CPU comm op keeps no buffer there")
@pytest.mark.parametrize("mode", ["deepspeed", "deepspeed_without_release"])
def test_finish_removes_deepspeeds_shared_memory_buffers(tmp_path, mode):
    """DeepSpeed's CPU comm op never unlinks its 66 MB per-rank buffer; finish() does. The op makes one where
    LOCAL_SIZE (the deepspeed launcher sets it) equals the world size. Control: the same launch ended without
    finish() leaves both behind (removed here)."""
    done = launch(tmp_path, mode, LOCAL_SIZE="2")
    port = next(arg.split("=")[1] for arg in done.cmd if arg.startswith("--master_port="))  # after any retry
    left = shm_buffers(port)
    for name in left:
        os.unlink(os.path.join("/dev/shm", name))
    if mode == "deepspeed":
        assert done.ok, done.failure()
        assert left == [], left
    else:
        assert len(left) == 2, (left, done.failure())


def test_a_scenario_failing_on_one_rank_ends_the_launch_instead_of_hanging(tmp_path):
    """tests/support/distributed_scenarios.py: the last rank fails while rank 0 waits for a message it never sends.
    The failing rank ends its process, the launcher stops the other, and the launch fails with the traceback; before,
    it went on to its next scenario and the launch hung until its timeout (a DeepSpeed release whose hpZ fails on
    half the ranks of a 4-rank launch hung it for 15 minutes). A hang here fails the test by its timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(TESTS, "support", "distributed_scenarios.py"), "--out", str(tmp_path), "--scenarios",
           "fails_on_one_rank"]
    done = run_ranks(cmd, 2, env=launch_env(), timeout=600)
    assert not done.ok and done.returncode != 0
    assert "scenario fails_on_one_rank failed on rank 1 of 2" in done.output, done.failure()
    assert "a scenario failing on one rank only" in done.output
    assert not os.path.exists(tmp_path / "results_world2.json")  # nothing claims the launch succeeded


def test_a_failed_launch_shows_the_first_traceback_as_well_as_the_end():
    """The cause is the first rank's traceback; the end of the output holds the others' broken connections."""
    from deepspeed_bnb.utils.teardown import Launch
    cause = "Traceback (most recent call last):\n  IndexError: start out of range\n"
    noise = "Connection reset by peer\n" * 1000
    failed = Launch(["launch"], 1, "", "start\n" + cause + noise, 2, [])
    assert "IndexError: start out of range" in failed.failure() and failed.failure().endswith(noise[-100:])
    short = Launch(["launch"], 1, "", cause, 2, [])  # control: a cause within the end is shown once
    assert short.failure().count("IndexError") == 1 and "the first traceback" not in short.failure()
