"""Every CUDA compile of tests/kernels/test_cuda_build.py, run as one fresh process beside the suite's other tests
(tests/support/background.py): nvcc for each kernel (sm_80 and sm_90; and for sm_90 with a candidate launch shape,
as DEEPSPEED_BNB_CUDA_SHAPE builds it) and the GPU proof's launch-shape variants (sm_90, then their list of shapes,
linked and run: `kernel_variants_shapes`), g++ syntax checks of the torch bindings. Writes `<folder>/results.json`:
name -> [return code, stderr], or {"skip": why} where nvcc or the CUDA headers are missing; the objects beside it.

    python tests/support/cuda_compiles.py FOLDER
"""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
CSRC = os.path.join(ROOT, "csrc")
# the GPU proof's launch-shape sweep (tests/gpu/part_variants.py): every rule's kernel in each shape, and its binding
VARIANTS = os.path.join(ROOT, "benchmarks", "kernel_variants")
sys.path.insert(0, ROOT)
from deepspeed_bnb.ops.build_flags import CUDA_SOURCES, NVCC_FLAGS, cuda_shape_flags  # noqa: E402

KERNELS = [os.path.basename(path)[:-len(".cu")] for path in CUDA_SOURCES if path.endswith(".cu")]
BINDINGS = [os.path.basename(path)[:-len(".cpp")] for path in CUDA_SOURCES if path.endswith("_cuda.cpp")]
# a candidate shape as the GPU proof may build the product with (every choice the kernel body has: selects, the
# table-only quantizer)
CANDIDATE_SHAPE = "3,true,false,1,true,false,true"


class Missing(Exception):
    """A tool or header the compiles need is not installed."""


def nvcc() -> str:
    found = shutil.which("nvcc") or (os.path.isfile("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
    if not found:
        raise Missing("nvcc (the CUDA compiler) is not installed on this machine")
    return found


def cuda_include() -> str:
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda",
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc())))]
    for home in candidates:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    raise Missing(f"no CUDA headers (cuda_runtime.h) under {candidates}")


def kernel_command(kernel, out_dir, source=None, arches=(80, 90), flags=(), output=None):
    gencode = [x for arch in arches for x in ("-gencode", f"arch=compute_{arch},code=sm_{arch}")]
    return [nvcc(), "-c", "-std=c++17", *NVCC_FLAGS, *flags, f"-I{os.path.join(CSRC, 'include')}",
            f"-I{os.path.join(CSRC, 'cuda')}", *gencode, source or os.path.join(CSRC, "cuda", f"{kernel}.cu"), "-o",
            os.path.join(out_dir, f"{output or kernel}.o")]


def binding_command(binding, source=None):
    import torch
    torch_include = os.path.join(os.path.dirname(torch.__file__), "include")
    return ["g++", "-fsyntax-only", "-std=c++20", f"-I{os.path.join(TESTS, 'cuda_shim')}",
            f"-I{torch_include}", f"-I{os.path.join(torch_include, 'torch', 'csrc', 'api', 'include')}",
            f"-I{cuda_include()}", f"-I{os.path.join(CSRC, 'include')}", f"-I{os.path.join(CSRC, 'cuda')}",
            f"-I{VARIANTS}", source or os.path.join(CSRC, "cuda", f"{binding}.cpp")]


def commands(out_dir) -> dict:
    return {**{k: kernel_command(k, out_dir) for k in KERNELS}, **{b: binding_command(b) for b in BINDINGS},
            **{f"{k}_candidate_shape": kernel_command(k, out_dir, arches=(90,), flags=cuda_shape_flags(CANDIDATE_SHAPE),
                                                      output=f"{k}_candidate_shape") for k in KERNELS},
            "kernel_variants": kernel_command("kernel_variants", out_dir,
                                              os.path.join(VARIANTS, "kernel_variants.cu"), arches=(90,)),
            "kernel_variants_binding": binding_command("kernel_variants_binding",
                                                       os.path.join(VARIANTS, "kernel_variants_binding.cpp"))}


def list_shapes(out_dir: str) -> list:
    """[return code, stdout or stderr] of the variants' shape list (benchmarks/kernel_variants/list_shapes.cpp),
    linked against their object: a host program that calls no CUDA function, so it runs without a GPU."""
    program = os.path.join(out_dir, "list_shapes")
    includes = [f"-I{os.path.join(CSRC, 'include')}", f"-I{os.path.join(CSRC, 'cuda')}"]
    link = subprocess.run([nvcc(), "-std=c++17", *includes, os.path.join(out_dir, "kernel_variants.o"),
                           os.path.join(VARIANTS, "list_shapes.cpp"), "-o", program], capture_output=True, text=True)
    if link.returncode != 0:
        return [link.returncode, link.stderr]
    run = subprocess.run([program], capture_output=True, text=True)
    return [run.returncode, run.stdout if run.returncode == 0 else run.stderr]


def main(out_dir: str) -> None:
    try:
        todo = commands(out_dir)
    except Missing as exc:
        results = {"skip": str(exc)}
    else:  # side by side, each one process (on 2 cores beside the suite's foreground test, two at a time)
        with ThreadPoolExecutor(max_workers=2) as pool:
            runs = dict(zip(todo, pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True),
                                           todo.values())))
        results = {name: [run.returncode, run.stderr] for name, run in runs.items()}
        if runs["kernel_variants"].returncode == 0:
            results["kernel_variants_shapes"] = list_shapes(out_dir)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
