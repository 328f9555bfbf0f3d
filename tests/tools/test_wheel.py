"""The sdist and the wheel carry the kernels' sources and, installed in a fresh venv away from the checkout, build and
use them.

`python -m build` (an sdist, then the wheel built from that sdist: what a release publishes, and what `pip install`
of the sdist does) runs on this checkout; both archives hold every kernel source, and so does `pip wheel .` (what
`pip install .` and `pip install git+...` build). The wheel goes into a fresh venv whose only other packages are this
venv's dependencies (torch, DeepSpeed, bitsandbytes: a .pth file, which does not run this venv's editable hook, so the
checkout is not importable there); its own `deepspeed-bnb kernels` command, run elsewhere with a JIT cache of its own,
builds the installed csrc/ and passes the first-use check of every rule and master mode, and a ZeRO-2 engine takes
three steps with the fused kernel. Control: the same install without its csrc/ says so, names the folder, and says
that bitsandbytes' own update steps instead. (DEEPSPEED_BNB_BUILD_EXT=1 wheels: tests/kernels/test_build.py.)
"""

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, without_launch_vars
from support import background, wheel_install

sys.path.insert(0, ROOT)
from deepspeed_bnb.ops.build_flags import CPU_SOURCES, CUDA_SOURCES  # noqa: E402

pytestmark = pytest.mark.slow
SOURCES = CPU_SOURCES + CUDA_SOURCES + ["csrc/include/dsbnb/adam8bit.h", "csrc/include/dsbnb/master_weights.h"]
# what the examples and benchmarks import from the package besides its runtime
MODULES = ["deepspeed_bnb/demo/gpt.py", "deepspeed_bnb/demo/text.py", "deepspeed_bnb/demo/elastic.py",
           "deepspeed_bnb/utils/teardown.py"]
# tests/support/wheel_install.py builds, installs and uses the wheel beside the earlier tests (support/background.py);
# the timeout only ends a hang
INSTALLED = background.Job("installed", lambda folder: [sys.executable, wheel_install.__file__, folder],
                           without_launch_vars, timeout=3600)
BACKGROUND_JOBS = (INSTALLED,)


@pytest.fixture(scope="module")
def installed():
    """What wheel_install.py recorded (wheel.json), with the venv's Python, its site-packages, the environment of a
    child run from it and the job's folder as paths."""
    done = background.result(INSTALLED)
    path = pathlib.Path(done.folder) / wheel_install.RESULT
    assert path.is_file(), f"wheel_install.py wrote nothing (exit {done.returncode}):\n{done.stdout[-3000:]}" \
                           f"{done.stderr[-3000:]}"
    record = json.loads(path.read_text())
    failed = record["failed"]
    assert not failed, f"{failed}:\n" + "\n".join(f"{step}: {run['stdout'][-2000:]}{run['stderr'][-2000:]}"
                                                   for step, run in record["steps"].items() if run["returncode"])
    return record, pathlib.Path(record["python"]), pathlib.Path(record["site"]), record["env"], \
        pathlib.Path(done.folder)


def test_every_archive_holds_the_kernel_sources(installed):
    record = installed[0]
    for archive, prefix in (("sdist", ""), ("wheel", "deepspeed_bnb/"), ("pip wheel", "deepspeed_bnb/")):
        names = set(record["archives"][archive])
        missing = [source for source in SOURCES if prefix + source not in names]
        missing += [module for module in MODULES if module not in names]
        assert not missing, f"the {archive} lacks {missing}"


def test_the_installed_wheel_builds_its_kernels_and_trains(installed):
    record, _, site, _, _ = installed
    kernels, train = record["steps"]["kernels"], record["steps"]["train"]
    assert kernels["returncode"] == 0, kernels["stdout"][-3000:] + kernels["stderr"][-3000:]
    assert "fused kernels: jit build" in kernels["stdout"], kernels["stdout"]
    assert kernels["stdout"].count("same bits as the reference") == 9, kernels["stdout"]  # 3 rules x 3 master modes
    line = [row for row in train["stdout"].splitlines() if row.startswith("RESULT ")]
    assert line, train["stdout"][-3000:] + train["stderr"][-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result["package"].startswith(str(site)), result["package"]  # the install, not the checkout
    assert "the fused kernel" in result["routes"].values(), result["routes"]
    assert all(loss == loss for loss in result["losses"]) and result["losses"][-1] < result["losses"][0]


def _run(command, env, cwd, timeout=1200):
    return subprocess.run(list(map(str, command)), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_control_an_install_without_its_sources_says_so(installed, tmp_path):
    _, python, site, env, _ = installed
    bare = tmp_path / "site"
    shutil.copytree(site / "deepspeed_bnb", bare / "deepspeed_bnb")
    shutil.rmtree(bare / "deepspeed_bnb" / "csrc")
    env = dict(env, PYTHONPATH=str(bare), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))  # ahead of the venv's
    kernels = _run([python, "-m", "deepspeed_bnb", "kernels", "--device", "cpu"], env, tmp_path)
    assert kernels.returncode == 1, kernels.stdout + kernels.stderr
    assert f"the C++ sources are neither in the package ({bare / 'deepspeed_bnb' / 'csrc'}" in kernels.stdout, \
        kernels.stdout
    assert "training steps with bitsandbytes' own update" in kernels.stdout, kernels.stdout
