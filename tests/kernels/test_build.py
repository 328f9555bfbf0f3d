"""How the operators are built and what happens when they cannot be: prebuilt by setup.py, or JIT, or the reference.

- `DEEPSPEED_BNB_BUILD_EXT=1 pip wheel .` produces a wheel holding deepspeed_bnb._C; its package (without the C++
  sources, so no JIT is possible) loads the prebuilt operator, and every rule's kernel-vs-reference test passes
  against it. On x86 it is built for x86-64-v2 (no AVX2: the portable loops that ARM and older x86 run), so the
  kernels are shown bit-identical to the reference on that path too (this machine's own JIT build runs the AVX2 or
  AVX-512 paths).
- Without a working build the loader says why (loader.error()) and the operators refuse to run: the ZeRO optimizer
  then steps with bnb's own update after one warning (tests/unit/test_routing.py); nothing silently runs the reference.
- A build is only ever loaded on a CPU with the instruction sets it was compiled for: setup.py records them beside
  _C and the loader refuses a prebuilt build this CPU cannot run (it would die with SIGILL); JIT builds are cached
  per set of instruction sets, so a shared cache never hands one CPU another's build.
"""

import os
import pathlib
import platform
import shutil
import subprocess
import sys
import types
import warnings
import zipfile

import pytest
import torch

from conftest import TESTS, without_launch_vars
from support import background
from deepspeed_bnb.ops import cpu_features, loader
from deepspeed_bnb.ops.build_flags import (CPU_FLAGS, CUDA_SHAPE_ENV, PORTABLE_ENV, cuda_shape_flags, cuda_shape_tag,
                                           prebuilt_cpu_flags)

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(TESTS)
X86 = platform.machine() in ("x86_64", "AMD64")
PREBUILT_LEVEL = "x86-64-v2" if X86 else ""  # elsewhere: this machine's CPU


# The wheel's build (the extension compiled, about 30 s on 2 cores) runs beside the earlier tests
# (tests/support/background.py); the timeout only ends a hang.
PREBUILT = background.Job("prebuilt_wheel", lambda folder: [
    sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-q", "-w", folder],
    lambda: {**os.environ, "DEEPSPEED_BNB_BUILD_EXT": "1", PORTABLE_ENV: PREBUILT_LEVEL}, timeout=1800)
BACKGROUND_JOBS = (PREBUILT,)


@pytest.fixture
def prebuilt_wheel():
    """The wheel `DEEPSPEED_BNB_BUILD_EXT=1 pip wheel .` built (for PREBUILT_LEVEL)."""
    built = background.result(PREBUILT)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    return next(pathlib.Path(built.folder).glob("deepspeed_bnb-*.whl"))


def test_prebuilt_extension_is_used(prebuilt_wheel, tmp_path):
    """A wheel built with DEEPSPEED_BNB_BUILD_EXT=1 (`pip wheel .`), on x86 for x86-64-v2 (SSE4.2: no AVX2, no
    AVX-512, so the portable loops and KeyTable::lookup run everywhere), holds deepspeed_bnb._C; its package without
    the C++ sources (so no JIT is possible) loads it, and every rule's kernel-vs-reference test passes against it."""
    wheel = prebuilt_wheel
    assert "py3-none-any" not in wheel.name, wheel.name  # a platform wheel: it holds a compiled extension
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "pkg")
    package = tmp_path / "pkg" / "deepspeed_bnb"
    assert list(package.glob("_C*.so")) and (package / "csrc").is_dir(), sorted(os.listdir(package))
    shutil.rmtree(package / "csrc")
    code = ("import sys, pytest; sys.path.insert(0, %r)\n"
            "from deepspeed_bnb.ops import loader\n"
            "from support.kernel_tests import RULE_TEST_FILES\n"
            "assert loader.load() and loader.source() == 'prebuilt', (loader.source(), loader.error())\n"
            "print('prebuilt', loader.__file__)\n"
            "sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', '-k', 'not cuda', *(%r + '/' + f for f in "
            "RULE_TEST_FILES)]))") % (TESTS, TESTS)
    env = {**without_launch_vars(), "PYTHONPATH": str(tmp_path / "pkg")}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)  # not the source tree: it would come first
    assert done.returncode == 0 and f"prebuilt {package}" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]

    # what the build needs is recorded beside it, and this CPU has it (else the run above would have been refused)
    needs = (package / cpu_features.ISA_FILE).read_text().split()
    assert needs == sorted(cpu_features.compiler_needs(prebuilt_cpu_flags(PREBUILT_LEVEL))) and needs
    assert not X86 or ("avx2" not in needs and "sse4_2" in needs)
    # the same package, but recorded as needing an instruction set this CPU lacks: refused before it is imported
    (package / cpu_features.ISA_FILE).write_text("\n".join(needs + ["avx512_not_on_this_cpu"]) + "\n")
    code = ("import sys, warnings\n"
            "from deepspeed_bnb.ops import loader\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    assert loader.load() is False\n"
            "assert 'deepspeed_bnb._C' not in sys.modules\n"
            "assert not caught, caught  # the caller (the ZeRO optimizer) warns, with what runs instead\n"
            "print(loader.error())")
    refused = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert refused.returncode == 0, refused.stdout + refused.stderr[-4000:]
    for words in ("avx512_not_on_this_cpu", "SIGILL", "DEEPSPEED_BNB_PORTABLE=1", "_C"):
        assert words in refused.stdout, refused.stdout


@pytest.mark.skipif(cpu_features.cpu_has() is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="reads /proc/cpuinfo and x86 compiler macros")
def test_compiler_needs_match_cpu_flags():
    # -march=native asks for what this CPU has: if a macro were mapped to the wrong /proc/cpuinfo name, the loader
    # would refuse every build here
    native = cpu_features.compiler_needs(CPU_FLAGS)
    assert native and cpu_features.missing(native) == []
    macros = [cpu_features.compiler_macros([f"-march=x86-64-{level}", "-O3", "-fopenmp"])
              for level in ("v2", "v3", "v4")]
    v2, v3, v4 = (cpu_features.needs_of(m) for m in macros)
    assert {"sse4_2", "popcnt"} <= v2 and "avx2" not in v2
    assert v2 < v3 and {"avx2", "fma", "bmi2", "f16c"} <= v3 and "avx512f" not in v3
    assert v3 < v4 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= v4
    assert len({cpu_features.build_tag(m) for m in macros}) == 3
    assert cpu_features.build_tag(cpu_features.compiler_macros(["-march=x86-64-v3"])) == cpu_features.build_tag(
        macros[1])  # -O3 and -fopenmp do not change the target
    assert cpu_features.missing(v4, has=v3) == ["avx512bw", "avx512cd", "avx512dq", "avx512f", "avx512vl"]
    # a compiler with a launcher in front, as CXX may name it ("ccache g++"; `env` stands in for the launcher)
    assert cpu_features.compiler_macros(["-march=x86-64-v3"], compiler="env c++") == cpu_features.compiler_macros(
        ["-march=x86-64-v3"], compiler="c++")


def test_jit_build_is_named_after_the_instruction_sets(monkeypatch, tmp_path):
    # two kinds of CPU sharing one TORCH_EXTENSIONS_DIR get two builds; the same kind, one
    import torch.utils.cpp_extension as cpp_extension
    names = []
    # _build records what it built (file, instruction sets) in the loader's state: a copy here, so the faked builds
    # do not become what built_file() and compiled_for() report for the real one in later tests
    monkeypatch.setattr(loader, "_state", dict(loader._state))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kwargs: names.append(name))
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(loader, "_prebuilt_refusal", lambda: None)

    def no_prebuilt(name):  # as if no deepspeed_bnb._C were installed, even where one is
        raise ImportError(name)
    monkeypatch.setattr(loader.importlib, "import_module", no_prebuilt)
    for macros in ("#define __AVX2__ 1", "#define __AVX2__ 1\n#define __AVX512F__ 1", "#define __AVX2__ 1"):
        monkeypatch.setattr(cpu_features, "compiler_macros", lambda flags, macros=macros: macros)
        assert loader._build(verbose=False) == "jit"
    assert names[0] != names[1] and names[0] == names[2] and names[0].startswith(loader.NAME)

    # a refused prebuilt build, then a JIT build that works: one warning says why the JIT ran
    monkeypatch.setattr(loader, "_prebuilt_refusal", lambda: "the prebuilt _C needs avx512f")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader._build(verbose=False) == "jit"
    assert len(caught) == 1 and "needs avx512f" in str(caught[0].message) and "JIT" in str(caught[0].message)


def test_a_candidate_cuda_shape_is_a_build_of_its_own(monkeypatch):
    # DEEPSPEED_BNB_CUDA_SHAPE: a JIT build (never the prebuilt one) whose name and nvcc flags carry the shape
    import torch
    import torch.utils.cpp_extension as cpp_extension
    builds, imported = [], []
    monkeypatch.setattr(loader, "_state", dict(loader._state))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kwargs: builds.append((name, kwargs)))
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(loader, "_prebuilt_refusal", lambda: None)
    prebuilt = types.SimpleNamespace(__file__="deepspeed_bnb/_C.so")  # what importing a prebuilt build gives
    monkeypatch.setattr(loader.importlib, "import_module", lambda name: imported.append(name) or prebuilt)
    monkeypatch.setattr(cpu_features, "read_needs", lambda path: None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv(CUDA_SHAPE_ENV, "3,true,false,1,true,false,true")
    assert loader._build(verbose=False) == "jit" and imported == []
    name, kwargs = builds[-1]
    assert name.endswith("_shape3tf1tft") and "-DDSBNB_CUDA_SHAPE=3101101" in kwargs["extra_cuda_cflags"]
    # control: without it, the prebuilt build is what loads
    monkeypatch.delenv(CUDA_SHAPE_ENV)
    assert loader._build(verbose=False) == "prebuilt" and imported == ["deepspeed_bnb._C"]


@pytest.mark.parametrize("value, named", [("3,true,false", "expected 7 comma-separated fields"),
                                          ("5,true,false,1,true,false,true", "blocks per SM is '5'"),
                                          ("3,yes,false,1,true,false,true", "full-block body is 'yes'"),
                                          ("3,true,true,1,true,true,false", "need the full-block body without"),
                                          ("2,true,false,2,true,true,true", "and not each other")])
def test_a_bad_cuda_shape_is_named(value, named):
    with pytest.raises(ValueError) as caught:
        cuda_shape_flags(value)
    assert CUDA_SHAPE_ENV in str(caught.value) and named in str(caught.value)
    assert cuda_shape_flags("") == [] and cuda_shape_tag("") == ""


def test_missing_toolchain_is_reported_not_hidden(monkeypatch):
    """No build: load() is False with the reason (asked twice, built once), and asking for the kernel raises instead
    of quietly running the reference. Control: the reference itself still runs."""
    monkeypatch.setattr(loader, "_state", {"loaded": None, "error": None, "source": None})
    monkeypatch.setattr(loader, "_has_op", lambda: False)
    tries = []

    def no_ninja(verbose):
        tries.append(verbose)
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(loader, "_build", no_ninja)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loader.load() is False
        assert loader.load() is False
    assert not caught and len(tries) == 1 and "Ninja is required" in loader.error()

    from support.rule_cases import CASES
    a = CASES["adam"].partition(5)
    with pytest.raises(RuntimeError, match="Ninja is required"):
        a.step(1, a.grads(1), True, 1.0)  # asks for the kernel
    before = a.params.clone()
    a.step(1, a.grads(1), False, 1.0)  # the reference
    assert not torch.equal(before, a.params)


def test_device_harness_runs_without_deepspeed_and_bitsandbytes():
    """tests/support/cuda_kernel_run.py (for a GPU machine that lacks both) with its stand-ins forced, on the CPU
    kernels: the kernel-vs-reference tests pass without DeepSpeed or bitsandbytes. Control: where there is no such
    device it fails instead of passing with everything skipped."""
    from conftest import run_or_fail, without_launch_vars
    harness = os.path.join(TESTS, "support", "cuda_kernel_run.py")
    env = {**without_launch_vars(), "DSBNB_STAND_INS": "deepspeed,bitsandbytes"}
    done = run_or_fail([sys.executable, harness, "--device", "cpu"], env, timeout=600, cwd=ROOT)
    assert "stand-ins for: deepspeed, bitsandbytes" in done.stdout, done.stdout[-3000:]
    passed = int(done.stdout.split(" kernel-vs-reference tests passed on cpu")[0].split()[-1])
    assert passed >= 40, done.stdout[-3000:]
    import torch
    if not torch.cuda.is_available():
        skipped = subprocess.run([sys.executable, harness], env=env, cwd=ROOT, capture_output=True, text=True)
        assert skipped.returncode != 0 and "no test ran" in skipped.stdout + skipped.stderr, skipped.stdout[-3000:]
