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
import sysconfig
import tarfile
import zipfile

import pytest

from conftest import ROOT, free_port, without_launch_vars

sys.path.insert(0, ROOT)
from deepspeed_bnb.ops.build_flags import CPU_SOURCES, CUDA_SOURCES  # noqa: E402

pytestmark = pytest.mark.slow
TRAIN = r"""
import json, os, torch
import bitsandbytes as bnb, deepspeed
import deepspeed_bnb
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "bnb_fused_kernel": True}}
engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
losses = []
for _ in range(3):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))  # one batch: the loss must fall
    loss = ((engine(x) - x) ** 2).mean()
    engine.backward(loss)
    engine.step()
    losses.append(float(loss))
routes = {name: str(route) for name, route in engine.optimizer.bnb_routes.items()}
print("RESULT " + json.dumps({"package": deepspeed_bnb.__file__, "losses": losses, "routes": routes}))
"""


SOURCES = CPU_SOURCES + CUDA_SOURCES + ["csrc/include/dsbnb/adam8bit.h", "csrc/include/dsbnb/master_weights.h"]
# what the examples and benchmarks import from the package besides its runtime
MODULES = ["deepspeed_bnb/demo/gpt.py", "deepspeed_bnb/demo/text.py", "deepspeed_bnb/demo/elastic.py",
           "deepspeed_bnb/utils/teardown.py"]


def _archive_names(path) -> set:
    if str(path).endswith(".whl"):
        with zipfile.ZipFile(path) as archive:
            return set(archive.namelist())
    with tarfile.open(path) as archive:  # the sdist: every name under its top folder, deepspeed_bnb-0.1.0/
        return {name.partition("/")[2] for name in archive.getnames()}


def _check(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(fresh venv's Python, its site-packages, the environment of a child run from it, a work folder) for the wheel
    `python -m build` made from this checkout's sdist."""
    folder = tmp_path_factory.mktemp("wheel")
    _check(subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(folder / "dist"), ROOT],
                          capture_output=True, text=True, timeout=900, check=False))
    sdist, wheel = next((folder / "dist").glob("deepspeed_bnb-*.tar.gz")), next((folder / "dist").glob("*.whl"))
    _check(subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(folder / "pip")], capture_output=True, text=True, timeout=900, check=False))
    pip_wheel = next((folder / "pip").glob("*.whl"))
    for archive, prefix in ((sdist, ""), (wheel, "deepspeed_bnb/"), (pip_wheel, "deepspeed_bnb/")):
        names = _archive_names(archive)
        missing = [source for source in SOURCES if prefix + source not in names]
        missing += [module for module in MODULES if module not in names]
        assert not missing, f"{archive.name} lacks {missing}"

    venv = folder / "venv"
    _check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True,
                          check=False))
    python = venv / "bin" / "python"
    site = pathlib.Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _check(subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                           str(wheel)], capture_output=True, text=True, timeout=600, check=False))
    env = dict(without_launch_vars(), TORCH_EXTENSIONS_DIR=str(folder / "extensions"))
    env.pop("PYTHONPATH", None)
    return python, site, env, folder


def _run(command, env, cwd, timeout=1200):
    return subprocess.run(list(map(str, command)), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_the_installed_wheel_builds_its_kernels_and_trains(installed):
    python, site, env, folder = installed
    kernels = _run([python.parent / "deepspeed-bnb", "kernels", "--device", "cpu"], env, folder)  # its own command
    assert kernels.returncode == 0, kernels.stdout[-3000:] + kernels.stderr[-3000:]
    assert "fused kernels: jit build" in kernels.stdout, kernels.stdout
    assert kernels.stdout.count("same bits as the reference") == 9, kernels.stdout  # 3 rules x 3 master modes
    rank = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    train = _run([python, "-c", TRAIN], rank, folder)
    line = [row for row in train.stdout.splitlines() if row.startswith("RESULT ")]
    assert line, train.stdout[-3000:] + train.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result["package"].startswith(str(site)), result["package"]  # the install, not the checkout
    assert "the fused kernel" in result["routes"].values(), result["routes"]
    assert all(loss == loss for loss in result["losses"]) and result["losses"][-1] < result["losses"][0]


def test_control_an_install_without_its_sources_says_so(installed, tmp_path):
    python, site, env, folder = installed
    bare = tmp_path / "site"
    shutil.copytree(site / "deepspeed_bnb", bare / "deepspeed_bnb")
    shutil.rmtree(bare / "deepspeed_bnb" / "csrc")
    env = dict(env, PYTHONPATH=str(bare), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))  # ahead of the venv's
    kernels = _run([python, "-m", "deepspeed_bnb", "kernels", "--device", "cpu"], env, tmp_path)
    assert kernels.returncode == 1, kernels.stdout + kernels.stderr
    assert f"the C++ sources are neither in the package ({bare / 'deepspeed_bnb' / 'csrc'}" in kernels.stdout, \
        kernels.stdout
    assert "training steps with bitsandbytes' own update" in kernels.stdout, kernels.stdout
