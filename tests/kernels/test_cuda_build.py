"""The CUDA kernels compile here, without a GPU: nvcc builds every kernel of build_flags.CUDA_SOURCES (csrc/cuda/*.cu)
for sm_80 and sm_90, and their torch bindings (csrc/cuda/*_cuda.cpp) pass a syntax check against this torch's headers
(the CPU wheel lacks one generated CUDA header, supplied by tests/cuda_shim). Running the kernels needs a GPU:
tests/kernels/test_fused_rules.py does it for every rule where one is present. Every CUDA source is one or the other
(test_every_cuda_source_is_checked); every rule has its CUDA implementation there (tests/unit/test_rules.py)."""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepspeed_bnb.ops.build_flags import CUDA_SOURCES, NVCC_FLAGS
from conftest import ROOT

pytestmark = pytest.mark.slow
CSRC = os.path.join(ROOT, "csrc")


def nvcc():
    found = shutil.which("nvcc") or (os.path.isfile("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
    if not found:
        pytest.skip("nvcc (the CUDA compiler) is not installed on this machine")
    return found


KERNELS = [os.path.basename(path)[:-len(".cu")] for path in CUDA_SOURCES if path.endswith(".cu")]
BINDINGS = [os.path.basename(path)[:-len(".cpp")] for path in CUDA_SOURCES if path.endswith("_cuda.cpp")]
# the GPU proof's launch-shape sweep (tests/gpu/part_variants.py): every rule's kernel in each shape, and its binding
VARIANTS = os.path.join(ROOT, "benchmarks", "kernel_variants")


def test_every_cuda_source_is_checked():
    """Each CUDA source is compiled by nvcc (a kernel) or syntax-checked (a binding), in csrc/cuda; and there are
    some (control: an empty list would pass every parametrized test below vacuously)."""
    assert KERNELS and BINDINGS
    assert sorted(CUDA_SOURCES) == sorted([f"csrc/cuda/{k}.cu" for k in KERNELS] +
                                          [f"csrc/cuda/{b}.cpp" for b in BINDINGS])


def _kernel_command(kernel, out_dir, source=None, arches=(80, 90)):
    gencode = [x for arch in arches for x in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    return [nvcc(), "-c", "-std=c++17", *NVCC_FLAGS, f"-I{os.path.join(CSRC, 'include')}",
            f"-I{os.path.join(CSRC, 'cuda')}", *gencode, source or os.path.join(CSRC, "cuda", f"{kernel}.cu"), "-o",
            os.path.join(out_dir, f"{kernel}.o")]


def cuda_include():
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", os.path.dirname(os.path.dirname(
        os.path.realpath(nvcc())))]
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    pytest.skip(f"no CUDA headers (cuda_runtime.h) under {candidates}")


def _binding_command(binding, source=None):
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    return ["g++", "-fsyntax-only", "-std=c++20", f"-I{os.path.join(ROOT, 'tests', 'cuda_shim')}",
            f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}",
            f"-I{cuda_include()}", f"-I{os.path.join(CSRC, 'include')}", f"-I{os.path.join(CSRC, 'cuda')}",
            f"-I{VARIANTS}", source or os.path.join(CSRC, "cuda", f"{binding}.cpp")]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every compile of this file, run side by side (each is one process): name -> (return code, stderr)."""
    out_dir = str(tmp_path_factory.mktemp("cuda_objects"))
    commands = {**{k: _kernel_command(k, out_dir) for k in KERNELS}, **{b: _binding_command(b) for b in BINDINGS},
                "kernel_variants": _kernel_command("kernel_variants", out_dir,
                                                   os.path.join(VARIANTS, "kernel_variants.cu"), arches=(90,)),
                "kernel_variants_binding": _binding_command("kernel_variants_binding",
                                                            os.path.join(VARIANTS, "kernel_variants_binding.cpp"))}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = dict(zip(commands, pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True),
                                           commands.values())))
    return {name: (run.returncode, run.stderr, out_dir) for name, run in runs.items()}


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_sm80_and_sm90(compiled, kernel):
    returncode, stderr, out_dir = compiled[kernel]
    assert returncode == 0, stderr[-4000:]
    assert os.path.getsize(os.path.join(out_dir, f"{kernel}.o")) > 0


@pytest.mark.parametrize("binding", BINDINGS)
def test_binding_syntax(compiled, binding):
    returncode, stderr, _ = compiled[binding]
    assert returncode == 0, stderr[-4000:]


def test_the_launch_shape_variants_compile(compiled):
    """The GPU proof's part k builds these on the device: every shape of every rule compiles for sm_90 (the H100 and
    H200 it runs on), and the binding against this torch's headers."""
    for name in ("kernel_variants", "kernel_variants_binding"):
        returncode, stderr, _ = compiled[name]
        assert returncode == 0, f"{name}: {stderr[-4000:]}"
