"""What travels to the GPU machine for the proof (the folder .device/, git-ignored), and how it is installed there.

The GPU machines the proof is built for have Python 3.12 and a CUDA build of torch, nvcc and ninja, but no DeepSpeed
and no bitsandbytes, and no network. So the bundle carries, in at most 64 MiB with the repository:
- wheels/: DeepSpeed as a pure-Python wheel built here with DS_BUILD_OPS=0 (its ops JIT-build there), and the
  pure-Python packages it needs that the machines' image lacks (MISSING_THERE), and torchao for part f's row of its
  8-bit AdamW (OPTIONAL_THERE), for CPython 3.12;
- site/: bitsandbytes as installed here, trimmed to the CPU library and the one CUDA library the machines' torch
  loads (cu130), with its dist-info (deepspeed_bnb checks its version at import);
- cpu_checkpoint/: a 2-rank CPU checkpoint and its DP-1 continuation (cross_device.py), for part d;
- bundle.json: what was bundled, from which versions, and the size that travels.

    .venv/bin/python tests/gpu/proof.py --prepare      # here, with the network: builds .device/ (about a minute)

There, proof.py installs the wheels with pip (no index, no dependency resolution) into a folder of its own that it
puts first on its children's PYTHONPATH: a carried wheel is installed only where the machine lacks the package or has a
version another carried wheel refuses (`plan`), so the image's own numpy or typing-extensions are not shadowed.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from typing import Callable, Dict, List, Optional, Tuple

import proof_common as common

BUNDLE = os.path.join(common.ROOT, ".device")
WHEELS, SITE, CHECKPOINT, MANIFEST = "wheels", "site", "cpu_checkpoint", "bundle.json"
PYTHON_THERE = "3.12"  # the GPU machines' Python
CUDA_THERE = "130"  # their torch is 2.11.0+cu130: bitsandbytes loads libbitsandbytes_cuda130.so
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# DeepSpeed's requirements the machines' image lacks (its package list: torch, numpy, packaging, psutil, py-cpuinfo,
# msgpack, ninja, einops, tqdm, nvidia-ml-py, typing-extensions, safetensors, pytest are there), and pydantic's own
MISSING_THERE = ("hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
ALWAYS = ("deepspeed",)  # installed from the bundle whatever the machine has: the proof is of this release
# no dependency of anything here: part f's row for torchao's AdamW8bit (what some users run today), tried as a DeepSpeed
# client where it imports. 0.17.0 (March 2026): its optimizers are pure PyTorch, and its C++ extensions, built for one
# torch release, are skipped by torchao itself where the machine's torch differs
OPTIONAL_THERE = ("torchao==0.17.0",)
LIMIT = 64 << 20  # bytes that may travel, the working tree included


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_name(path: str) -> Tuple[str, str]:
    """(normalized distribution name, version) from a wheel's file name."""
    name, version = os.path.basename(path).split("-")[:2]
    return normalize(name), version


def wheel_requirements(path: str) -> List[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(archive.read(metadata).decode()).get_all("Requires-Dist") or []


def installed_version(name: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def plan(wheels: List[str], installed: Callable[[str], Optional[str]] = installed_version) -> Dict[str, str]:
    """wheel path -> why it is installed (wheels not listed are skipped: the machine's own version serves).

    A wheel is installed when its package is in ALWAYS, absent there, or present in a version that a requirement of
    another carried wheel (markers evaluated here, extras ignored) does not admit."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    needs: Dict[str, list] = {}
    for path in wheels:
        for line in wheel_requirements(path):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            needs.setdefault(normalize(requirement.name), []).append((wheel_name(path)[0], requirement.specifier))
    chosen = {}
    for path in wheels:
        name, version = wheel_name(path)
        have = installed(name)
        refused = [f"{who} needs {name}{spec}" for who, spec in needs.get(name, ())
                   if have is not None and not spec.contains(Version(have), prereleases=True)]
        if name in ALWAYS:
            chosen[path] = f"{name} {version}: the release under test"
        elif have is None:
            chosen[path] = f"{name} {version}: not installed there"
        elif refused:
            chosen[path] = f"{name} {version}: {have} is installed, but {'; '.join(refused)}"
    return chosen


def install(bundle: str, target: str) -> dict:
    """Install the bundle's wheels that `plan` chooses into `target`; what was installed and skipped, and the
    PYTHONPATH entries the proof's children need (target, then the trimmed bitsandbytes)."""
    wheels = sorted(glob.glob(os.path.join(bundle, WHEELS, "*.whl")))
    if not wheels:
        raise FileNotFoundError(f"{os.path.join(bundle, WHEELS)} holds no wheels: run `python tests/gpu/proof.py "
                                f"--prepare` on a machine with the network first, and carry .device")
    chosen = plan(wheels)
    os.makedirs(target, exist_ok=True)
    if chosen:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--disable-pip-version-check", "--target", target, *chosen], check=True)
    skipped = {os.path.basename(p): f"{wheel_name(p)[0]} {installed_version(wheel_name(p)[0])} is installed there"
               for p in wheels if p not in chosen}
    return {"installed": {os.path.basename(p): why for p, why in chosen.items()}, "skipped": skipped,
            "pythonpath": [target, os.path.join(bundle, SITE)]}


def trimmed_bitsandbytes(folder: str, cuda: str = CUDA_THERE) -> int:
    """Copy the installed bitsandbytes into folder/site without the native libraries of other CUDA versions, ROCm and
    XPU (its pure Python, the CPU library and one CUDA library), with its dist-info; returns the bytes written."""
    import bitsandbytes
    source = os.path.dirname(bitsandbytes.__file__)
    site = os.path.join(folder, SITE)
    keep = {f"libbitsandbytes_cuda{cuda}.so", "libbitsandbytes_cpu.so"}
    if not os.path.isfile(os.path.join(source, f"libbitsandbytes_cuda{cuda}.so")):
        sys.exit(f"{source} has no libbitsandbytes_cuda{cuda}.so; pick the CUDA version from the ones it has")
    target = os.path.join(site, "bitsandbytes")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, ignore=lambda d, names: [n for n in names if n == "__pycache__" or (
        n.startswith("libbitsandbytes_") and n not in keep)])
    info = glob.glob(os.path.join(os.path.dirname(source), f"bitsandbytes-{bitsandbytes.__version__}.dist-info"))
    for found in info:
        shutil.copytree(found, os.path.join(site, os.path.basename(found)), dirs_exist_ok=True)
    return folder_bytes(site)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def wheels_for_there(folder: str) -> List[str]:
    """DeepSpeed's wheel (built here, no ops), MISSING_THERE's (the versions installed here) and OPTIONAL_THERE's, for
    CPython 3.12."""
    out = os.path.join(folder, WHEELS)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation",
                    f"deepspeed=={installed_version('deepspeed')}", "-w", out],
                   check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_THERE,
                    "--implementation", "cp", *platforms, "-d", out,
                    *(f"{name}=={installed_version(name)}" for name in MISSING_THERE), *OPTIONAL_THERE], check=True)
    return sorted(glob.glob(os.path.join(out, "*.whl")))


def cpu_checkpoint(folder: str, python: str = sys.executable, env: Optional[dict] = None) -> str:
    """The 2-rank CPU checkpoint and its DP-1 continuation (cross_device.py) in folder/cpu_checkpoint."""
    import cross_device
    from deepspeed_bnb.utils import teardown
    target = os.path.join(folder, CHECKPOINT)
    shutil.rmtree(target, ignore_errors=True)
    script = os.path.join(common.GPU, "cross_device.py")
    launches = ((2, ["make", "--dir", target]),
                (1, ["resume", "--dir", target, "--tag", cross_device.CPU_TAG, "--record",
                     os.path.join(target, cross_device.CONTINUATION)]))
    for ranks, args in launches:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               f"--master_port={common.free_port()}", script, *args]
        launch = teardown.run_ranks(cmd, ranks, env=env, timeout=600)
        if not launch.ok:
            raise RuntimeError(launch.failure())
    return target


def traveling_bytes(bundle: str) -> int:
    """Bytes the device tool sends: the files git tracks or does not ignore, and the carried bundle."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=common.ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    tree = sum(os.path.getsize(os.path.join(common.ROOT, f)) for f in listed
               if f and os.path.isfile(os.path.join(common.ROOT, f)))
    return tree + folder_bytes(bundle)


LIBAIO = "libaio"  # bundle folder: include/libaio.h, lib/libaio.so.1 (and libaio.so), for DeepSpeed's async_io op
LIBAIO_HEADER, LIBAIO_LIBRARY = "/usr/include/libaio.h", "/usr/lib/x86_64-linux-gnu/libaio.so.1"


def libaio(bundle: str) -> bool:
    """This machine's libaio header and library, for a GPU machine without libaio-dev (no network there to install
    it): part h builds DeepSpeed's async_io op against them. False where this machine has none."""
    if not (os.path.isfile(LIBAIO_HEADER) and os.path.isfile(LIBAIO_LIBRARY)):
        return False
    target = os.path.join(bundle, LIBAIO)
    os.makedirs(os.path.join(target, "include"), exist_ok=True)
    os.makedirs(os.path.join(target, "lib"), exist_ok=True)
    shutil.copy(LIBAIO_HEADER, os.path.join(target, "include", "libaio.h"))
    for name in ("libaio.so.1", "libaio.so"):
        shutil.copy(os.path.realpath(LIBAIO_LIBRARY), os.path.join(target, "lib", name))
    return True


def prepare(bundle: str = BUNDLE) -> dict:
    """Build the whole bundle; refuses one that would not travel."""
    import bitsandbytes
    os.makedirs(bundle, exist_ok=True)
    wheels = wheels_for_there(bundle)
    bnb_bytes = trimmed_bitsandbytes(bundle)
    cpu_checkpoint(bundle)
    manifest = {"wheels": [os.path.basename(w) for w in wheels], "bitsandbytes": bitsandbytes.__version__,
                "bitsandbytes_bytes": bnb_bytes, "cuda_library": CUDA_THERE, "python_there": PYTHON_THERE,
                "checkpoint": CHECKPOINT, "libaio": libaio(bundle), "traveling_bytes": traveling_bytes(bundle)}
    common.write_json(os.path.join(bundle, MANIFEST), manifest)
    if manifest["traveling_bytes"] > LIMIT:
        raise SystemExit(f"{bundle}: {manifest['traveling_bytes'] / 2**20:.1f} MiB would travel with the working "
                         f"tree, over the device tool's {LIMIT >> 20} MiB; remove untracked files or trim the bundle")
    return manifest


if __name__ == "__main__":
    print(json.dumps(prepare(sys.argv[1] if len(sys.argv) > 1 else BUNDLE), indent=1))
