"""Builds this checkout's sdist and wheels, installs the wheel in a fresh venv and uses it there; writes wheel.json.

For tests/tools/test_wheel.py, which runs it as a background job (tests/support/background.py) and checks what it
recorded. In FOLDER (the one argument):
- `python -m build` (an sdist, then the wheel built from that sdist) and `pip wheel .`: dist/ and pip/, and the names
  each archive holds;
- a venv (venv/) whose only other packages are this venv's dependencies, through a .pth file (which does not run this
  venv's editable hook, so the checkout is not importable there), with the wheel installed;
- the installed `deepspeed-bnb kernels --device cpu`, with a JIT cache of its own (extensions/), and a ZeRO-2 engine
  taking three steps (TRAIN), each run from FOLDER: return code and output.
A step that fails is recorded with its output and ends the script (exit 1) after writing wheel.json.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
RESULT = "wheel.json"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")

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


def archive_names(path: pathlib.Path) -> list:
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as archive:
            return sorted(archive.namelist())
    with tarfile.open(path) as archive:  # the sdist: every name under its top folder, deepspeed_bnb-0.1.0/
        return sorted(name.partition("/")[2] for name in archive.getnames())


# DeepSpeed's CPU comm op, which init_distributed builds (40 s of g++ on 2 cores): the suite's build of it is reused in
# the fresh JIT cache, so what builds there is the installed wheel's kernel alone (DeepSpeed and torch are the suite's
# own, through the .pth file, and so are the sources and flags its build.ninja names).
DEEPSPEED_OPS_REUSED = ("deepspeed_shm_comm",)


def reuse_deepspeeds_ops(extensions: pathlib.Path) -> None:
    suite = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not suite:  # no suite cache named: the op builds in the fresh one, as before
        return
    for op in DEEPSPEED_OPS_REUSED:
        built = pathlib.Path(suite, op)
        if built.is_dir() and not (built / "lock").exists():  # torch's build lock: a build under way is not copied
            shutil.copytree(built, extensions / op)  # with their times: ninja finds them up to date


class Failed(Exception):
    pass


def run(record: dict, step: str, command, env=None, cwd=None, timeout=1200, must_pass=True) -> str:
    done = subprocess.run(list(map(str, command)), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)
    record[step] = {"returncode": done.returncode, "stdout": done.stdout[-20000:], "stderr": done.stderr[-20000:]}
    if must_pass and done.returncode != 0:
        raise Failed(f"{step} exited with {done.returncode}")
    return done.stdout


def main(folder: pathlib.Path) -> int:
    from deepspeed_bnb.utils.teardown import unused_port
    record = {"steps": {}, "archives": {}, "failed": None}
    steps = record["steps"]
    try:
        run(steps, "build", [sys.executable, "-m", "build", "--no-isolation", "--outdir", folder / "dist", ROOT],
            timeout=900)
        run(steps, "pip wheel", [sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation",
                                 "-q", "-w", folder / "pip"], timeout=900)
        sdist = next((folder / "dist").glob("deepspeed_bnb-*.tar.gz"))
        wheel = next((folder / "dist").glob("*.whl"))
        pip_wheel = next((folder / "pip").glob("*.whl"))
        record["archives"] = {"sdist": archive_names(sdist), "wheel": archive_names(wheel),
                              "pip wheel": archive_names(pip_wheel)}
        venv = folder / "venv"
        run(steps, "venv", [sys.executable, "-m", "venv", "--without-pip", venv])
        python = venv / "bin" / "python"
        site = pathlib.Path(run(steps, "site", [python, "-c", "import sysconfig; "
                                                "print(sysconfig.get_paths()['purelib'])"]).strip())
        (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        run(steps, "install", [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel],
            timeout=600)
        record.update(python=str(python), site=str(site))
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PYTHONPATH"}
        env["TORCH_EXTENSIONS_DIR"] = str(folder / "extensions")
        reuse_deepspeeds_ops(folder / "extensions")
        record["env"] = env
        run(steps, "kernels", [python.parent / "deepspeed-bnb", "kernels", "--device", "cpu"], env, folder,
            must_pass=False)  # its own command; the test reads what it said
        rank = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(unused_port()))
        run(steps, "train", [python, "-c", TRAIN], rank, folder, must_pass=False)
    except (Failed, StopIteration, subprocess.TimeoutExpired) as exc:
        record["failed"] = f"{type(exc).__name__}: {exc}"
    (folder / RESULT).write_text(json.dumps(record, indent=1))
    return 1 if record["failed"] else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(pathlib.Path(sys.argv[1])))
