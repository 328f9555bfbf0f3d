"""How the operators are built and what happens when they cannot be: prebuilt by setup.py, or JIT, or the reference.

- `DEEPSPEED_BNB_BUILD_EXT=1 setup.py build_ext` produces deepspeed_bnb._C; a package holding it (and no C++
  sources, so no JIT is possible) loads the prebuilt operator and its results equal the reference's.
- Without a working build the loader warns once and the fused step runs the pure-torch reference.
- Built for a CPU without AVX2 (the portable loops that ARM and older x86 run), the kernels are still bit-identical
  to the reference (this machine's own build runs the AVX2 or AVX-512 paths instead).
"""

import os
import platform
import shutil
import subprocess
import sys
import warnings

import pytest

from conftest import TESTS
from deepspeed_bnb.ops import loader

ROOT = os.path.dirname(TESTS)


def test_prebuilt_extension_is_used(tmp_path):
    env = {**os.environ, "DEEPSPEED_BNB_BUILD_EXT": "1"}
    built = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                            "--build-temp", str(tmp_path / "tmp")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    package = tmp_path / "pkg" / "deepspeed_bnb"
    shutil.copytree(os.path.join(ROOT, "deepspeed_bnb"), package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in os.listdir(tmp_path / "lib" / "deepspeed_bnb"):
        shutil.copy(tmp_path / "lib" / "deepspeed_bnb" / name, package / name)
    code = ("import torch, sys; sys.path.insert(0, %r)\n"

            "from test_fused_step import Partition\n"
            "from deepspeed_bnb.ops import loader\n"
            "assert loader.load() and loader.source() == 'prebuilt', (loader.source(), loader.error())\n"
            "a = Partition(3); b = a.clone(); g = a.grads(1)\n"
            "a.step(1, g, True, 1.0); b.step(1, g, False, 1.0)\n"
            "assert torch.equal(a.params, b.params) and torch.equal(a.codes1, b.codes1)\n"
            "print('ok', loader.__file__)") % TESTS
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "pkg")},
                          cwd=tmp_path, capture_output=True, text=True)  # not the source tree: it would come first
    assert done.returncode == 0 and str(package) in done.stdout, done.stdout + done.stderr[-4000:]


def test_missing_toolchain_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(loader, "_state", {"loaded": None, "error": None, "source": None})
    monkeypatch.setattr(loader, "_has_op", lambda: False)

    def no_ninja(verbose):
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(loader, "_build", no_ninja)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.load() is False
        assert loader.load() is False
    assert len(caught) == 1 and "Ninja is required" in str(caught[0].message)
    assert "bnb_fused_kernel: false" in str(caught[0].message)

    from test_fused_step import Partition
    a = Partition(5)
    b = a.clone()
    grads = a.grads(1)
    a.step(1, grads, True, 1.0)  # asks for the kernel, gets the reference
    b.step(1, grads, False, 1.0)
    import torch
    assert torch.equal(a.params, b.params) and torch.equal(a.codes2, b.codes2)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="builds for -march=x86-64-v2 (an x86 CPU)")
def test_portable_build_without_avx2_matches_the_reference(tmp_path):
    from conftest import run_or_fail, without_launch_vars
    env = {**without_launch_vars(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    done = run_or_fail([sys.executable, os.path.join(TESTS, "portable_kernel_run.py")], env, timeout=900, cwd=ROOT)
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
