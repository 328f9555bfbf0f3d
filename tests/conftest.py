"""What every kind of test shares (tests/unit, kernels, distributed, tools, gpu): tests/ on sys.path for the support
package, the JIT guard, a one-rank gloo process group for in-process engines, and torchrun launches for multi-rank
runs."""

import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
if TESTS not in sys.path:  # `import support` from every folder of tests (support/__init__.py)
    sys.path.insert(0, TESTS)


def extensions_dir(python: str) -> str:
    """The JIT cache of the venv `python` belongs to (VENV/bin/python -> VENV/torch_extensions)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(python))), "torch_extensions")


# A JIT cache of the suite's own venv unless the user chose one: DeepSpeed gives its CPU comm op one name in every
# release, so a venv of another DeepSpeed sharing ~/.cache/torch_extensions would load the other's build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(sys.executable))
# No JIT build lock hangs the suite (tests/support/jit_guard.py): waits bounded, a dead builder's lock removed; here,
# and in every child the suite starts (sitecustomize in tests/support/site, on the PYTHONPATH they inherit).
GUARD_SITE = os.path.join(TESTS, "support", "site")
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([GUARD_SITE, *filter(None, os.environ.get(
    "PYTHONPATH", "").split(os.pathsep))]))
from support import jit_guard  # noqa: E402

jit_guard.install()
# The rule every multi-rank launch here is judged by, and its retry on a port taken meanwhile, come from
# deepspeed_bnb.utils.teardown, imported where used: importing it imports deepspeed_bnb, and the GPU proof's parent
# process imports this module before DeepSpeed is installed there (tests/gpu/proof_common.py).


def free_port() -> int:
    """A port free now; launches through run_ranks retry on another when it was taken before they bound it."""
    from deepspeed_bnb.utils.teardown import unused_port
    return unused_port()


# Markers (pytest.ini: multi_rank, slow, gpu) are declared by the test modules themselves, at their top
# (`pytestmark`) or on a test; tests/unit/test_suite_setup.py checks that every module launching ranks declares
# multi_rank. `make test-quick` runs what is neither multi_rank nor slow, `make test` everything.

TEST_EXTRA = ("accelerate", "transformers", "trl", "datasets", "matplotlib", "build")  # setup.py's "test" extra


SESSION = {}  # "start": the session's time.time(); "swept": the comm buffers swept at its end


def pytest_sessionstart(session):
    """The suite needs the `test` extra (the client tests, and the multi-rank scenarios' models import transformers):
    without it, say so once, by name, instead of failing inside a rank. A run of named files only (the GPU proof's
    kernel tests, on a machine without the extra) is not held to it: a file that needs a missing package fails at its
    own import, which names the package."""
    import importlib.util
    import time
    SESSION["start"] = time.time()
    root = session.config.invocation_params.dir
    paths = [os.path.join(root, arg.split("::")[0]) for arg in session.config.args]
    if paths and all(os.path.isfile(path) for path in paths):
        return
    missing = [name for name in TEST_EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(f"the test suite needs {', '.join(missing)} (setup.py's `test` extra): run "
                                f"`pip install -e .[test]`, or `make test`, which sets up a venv with it")


def pytest_collection_finish(session):
    """Before any test: where tests that launch ranks or start fresh processes were collected, every JIT build they
    load (tests/support/prebuild.py, no deadline); then start the fresh-process jobs the collected tests will read
    (tests/support/background.py) beside them."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("multi_rank") or item.get_closest_marker("slow") for item in session.items):
        from support import prebuild
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        if report is not None:
            report.write_line("building (or finding built) the JIT ops the suite's launches load ...")
        ops = prebuild.suite_ops()
        done = prebuild.build(ops, without_launch_vars())
        if report is not None:
            for line in done.stdout.splitlines():
                if line.startswith(("deepspeed_bnb kernels:", *ops)) or "killed after" in line:
                    report.write_line("  " + line)
    from support import background
    background.start_for(session.items)


def pytest_sessionfinish(session):
    from support import background
    background.stop()
    if "start" in SESSION:  # DeepSpeed never unlinks its CPU comm buffers; a rank killed before finish() leaves its own
        from deepspeed_bnb.utils.teardown import sweep_shm_buffers
        SESSION["swept"] = sweep_shm_buffers(SESSION["start"])


def pytest_terminal_summary(terminalreporter):
    """The background jobs' start and run times, after the durations: where a slow suite waited on its queue; the
    comm buffers swept at the session's end."""
    from support import background
    lines = background.report()
    if lines:
        terminalreporter.section("background jobs")
        for line in lines:
            terminalreporter.write_line(line)
    swept = SESSION.get("swept")
    if swept:  # a leak to look into: every launch of the suite releases its ranks' buffers when they end normally
        terminalreporter.section("shared memory")
        terminalreporter.write_line(f"removed {len(swept)} buffer(s) of DeepSpeed's CPU comm op that ranks of this "
                                    f"session left in /dev/shm (66 MB each; a rank killed before finish()): "
                                    f"{', '.join(swept[:4])}{' ...' if len(swept) > 4 else ''}")


@pytest.fixture(scope="session")
def one_rank():
    """deepspeed.comm initialised as rank 0 of 1 (gloo, CPU), once per test session; on another port when the one
    picked was taken before the store bound it (a busy machine)."""
    import deepspeed
    from deepspeed import comm as dist

    from deepspeed_bnb.utils.teardown import PORT_TAKEN, PORT_TRIES
    for attempt in range(PORT_TRIES):
        if dist.is_initialized():
            break
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        try:
            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        except Exception as exc:  # the TCP store's bind: DistNetworkError / RuntimeError naming EADDRINUSE
            if not PORT_TAKEN.search(str(exc)) or attempt == PORT_TRIES - 1:
                raise
    yield dist
    from deepspeed_bnb.utils.teardown import release_shm_buffer
    release_shm_buffer(0)  # DeepSpeed's CPU comm op leaves its 66 MB buffer in /dev/shm otherwise


# The in-process one-rank group (fixture above) set these; a launcher's ranks must not inherit them.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def without_launch_vars() -> dict:
    """This process's environment minus the rank variables, for a child that starts its own process group."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}


def launch_env(python: str = sys.executable) -> dict:
    """The environment of a multi-rank child run by `python`: no inherited rank variables, one OpenMP thread per rank,
    and faulthandler on (a native abort prints the Python stack). A Python of another venv (another DeepSpeed or
    bitsandbytes release) gets that venv's own JIT cache: DeepSpeed's CPU comm op of two releases under one
    TORCH_EXTENSIONS_DIR has the same name and other sources, so each switch would rebuild it (about a minute)."""
    env = without_launch_vars()
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    if os.path.abspath(python) != os.path.abspath(sys.executable):
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir(python)
    return env


def run_or_fail(cmd, env: dict, timeout: int, cwd=None, ranks: int = 0) -> subprocess.CompletedProcess:
    """Run `cmd`; fail the test with the tail of its output if it exits non-zero. With `ranks`, `cmd` launches that
    many ranks ending with teardown.finish(), and a launch that failed only by gloo's teardown abort after every
    rank was done passes (deepspeed_bnb/utils/teardown.py)."""
    if ranks:
        from deepspeed_bnb.utils.teardown import run_ranks
        launch = run_ranks(cmd, ranks, env=env, timeout=timeout, cwd=cwd)
        if not launch.ok:
            pytest.fail(launch.failure())
        return subprocess.CompletedProcess(cmd, launch.returncode, launch.stdout, launch.stderr)
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}")
    return done


def torchrun(script: str, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run tests/<script> (which ends with teardown.finish()) on `nproc` CPU ranks; fail with the tail of its output
    if it fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           os.path.join(TESTS, script), *args]
    return run_or_fail(cmd, launch_env(), timeout, ranks=nproc)


@pytest.fixture(scope="session")
def scenario_results(one_rank, scenario_folder):
    """Every multi-rank scenario's result, world -> scenario -> value (tests/support/scenario_runs.py: shared
    launches)."""
    from support.scenario_runs import run_all
    return run_all(scenario_folder)


@pytest.fixture(scope="session")
def scenario_folder(tmp_path_factory):
    """Where the shared launches write their checkpoints (read once scenario_results has run)."""
    return str(tmp_path_factory.mktemp("scenarios"))
