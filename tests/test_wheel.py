"""A wheel of the package carries the kernels' sources and, installed away from the checkout, builds and uses them.

`pip wheel .` (what `pip install .` and a release build) is built from this checkout and installed into a folder of its
own; a child whose import path starts there (its working folder elsewhere, a JIT cache of its own) imports the
installed package, not the checkout: `deepspeed-bnb kernels` JIT-builds the installed csrc/ and passes the first-use
check of every rule and master mode, and a ZeRO-2 engine takes three steps with the fused kernel. Control: the same
install without its csrc/ says so, names the folder, and says that bitsandbytes' own update steps instead.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import without_launch_vars, unused_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from deepspeed_bnb.ops.build_flags import CPU_SOURCES, CUDA_SOURCES  # noqa: E402

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


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site folder, environment of a child that imports from it) of the wheel built from this checkout."""
    folder = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(folder / "dist")], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheel = next((folder / "dist").glob("deepspeed_bnb-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for source in CPU_SOURCES + CUDA_SOURCES + ["csrc/include/dsbnb/adam8bit.h", "csrc/include/dsbnb/master_weights.h"]:
        assert f"deepspeed_bnb/{source}" in names, f"{source} is not in {wheel.name}"
    site = folder / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    env = dict(without_launch_vars(), PYTHONPATH=str(site), TORCH_EXTENSIONS_DIR=str(folder / "extensions"))
    return site, env, folder


def _run(args, env, cwd, timeout=1200):
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_the_installed_wheel_builds_its_kernels_and_trains(installed):
    site, env, folder = installed
    kernels = _run(["-m", "deepspeed_bnb", "kernels", "--device", "cpu"], env, folder)
    assert kernels.returncode == 0, kernels.stdout[-3000:] + kernels.stderr[-3000:]
    assert "fused kernels: jit build" in kernels.stdout, kernels.stdout
    assert kernels.stdout.count("same bits as the reference") == 9, kernels.stdout  # 3 rules x 3 master modes
    rank = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(unused_port()))
    train = _run(["-c", TRAIN], rank, folder)
    line = [row for row in train.stdout.splitlines() if row.startswith("RESULT ")]
    assert line, train.stdout[-3000:] + train.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result["package"].startswith(str(site)), result["package"]  # the install, not the checkout
    assert "the fused kernel" in result["routes"].values(), result["routes"]
    assert all(loss == loss for loss in result["losses"]) and result["losses"][-1] < result["losses"][0]


def test_control_an_install_without_its_sources_says_so(installed, tmp_path):
    site, env, folder = installed
    bare = tmp_path / "site"
    shutil.copytree(site, bare)
    shutil.rmtree(bare / "deepspeed_bnb" / "csrc")
    env = dict(env, PYTHONPATH=str(bare), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    kernels = _run(["-m", "deepspeed_bnb", "kernels", "--device", "cpu"], env, tmp_path)
    assert kernels.returncode == 1, kernels.stdout + kernels.stderr
    assert f"the C++ sources are neither in the package ({bare / 'deepspeed_bnb' / 'csrc'}" in kernels.stdout, \
        kernels.stdout
    assert "training steps with bitsandbytes' own update" in kernels.stdout, kernels.stdout
