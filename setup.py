"""deepspeed_bnb: bitsandbytes 8-bit optimizers as first-class citizens of DeepSpeed ZeRO stages 1, 2 and 3.

Install for development with `pip install -e .[test]` (or just `make test`, which also creates the venv).
torch is not pinned here: install the build you want first (the Makefile installs the CPU build when none is
present), otherwise pip resolves a multi-GB CUDA build through deepspeed's own dependency.

Environment variables:
  DEEPSPEED_BNB_BUILD_EXT=1   build the fused-optimizer operators now, as deepspeed_bnb._C (C++ CPU kernel, plus the
                              CUDA kernel when torch has CUDA), instead of JIT-compiling them with ninja on first use.
                              Needs torch in the build environment: pip install --no-build-isolation -e .
  DEEPSPEED_BNB_PORTABLE=1    with the above: compile the CPU kernel for AVX2 instead of this machine (-march=native),
                              for builds that run elsewhere; or name an x86-64 level (x86-64-v2: no AVX2 at all).
                              TORCH_CUDA_ARCH_LIST picks the GPU architectures.
"""

import importlib.util
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithKernelSources(build_py):
    """Copies csrc/ into the built package as deepspeed_bnb/csrc, so that a wheel (pip install ., pip wheel ., a
    release) carries the kernels' sources and the loader JIT-builds them on first use, as DeepSpeed ships its own
    ops' sources inside its package. An editable install reads csrc/ from the checkout instead."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            shutil.copytree(os.path.join(HERE, "csrc"), os.path.join(self.build_lib, "deepspeed_bnb", "csrc"),
                            dirs_exist_ok=True)


def _ops_module(name):
    """deepspeed_bnb/ops/<name>.py, loaded without importing the package (which needs torch and deepspeed)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, "deepspeed_bnb", "ops", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extensions():
    if os.environ.get("DEEPSPEED_BNB_BUILD_EXT") != "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    flags, features = (_ops_module(name) for name in ("build_flags", "cpu_features"))
    cpu_flags = flags.prebuilt_cpu_flags(os.environ.get(flags.PORTABLE_ENV, ""))
    sources = ["csrc/python_module.cpp", *flags.CPU_SOURCES]
    common = dict(include_dirs=[os.path.join(HERE, "csrc", "include")], extra_link_args=flags.LINK_FLAGS)
    if torch.version.cuda is not None:
        sources += flags.CUDA_SOURCES
        extension = CUDAExtension("deepspeed_bnb._C", sources,
                                  extra_compile_args={"cxx": cpu_flags, "nvcc": flags.NVCC_FLAGS}, **common)
    else:
        extension = CppExtension("deepspeed_bnb._C", sources, extra_compile_args={"cxx": cpu_flags}, **common)

    class BuildRecordingNeeds(BuildExtension):
        """Writes beside deepspeed_bnb._C the instruction sets its CPU code was compiled for: the loader refuses the
        build on a CPU that lacks one (it would die with SIGILL) instead of crashing the first optimizer step."""

        def build_extensions(self):
            super().build_extensions()
            needs = features.compiler_needs(cpu_flags)
            for ext in self.extensions:
                features.write_needs(self.get_ext_fullpath(ext.name), needs)

    return [extension], {"build_ext": BuildRecordingNeeds}


ext_modules, cmdclass = extensions()
cmdclass["build_py"] = BuildPyWithKernelSources

setup(
    name="deepspeed_bnb",
    version="0.1.0",
    description="Block-aware DeepSpeed ZeRO-1/2/3 for bitsandbytes 8-bit optimizers: elastic, resumable, fast.",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["deepspeed_bnb", "deepspeed_bnb.*"]),
    py_modules=["deepspeed_bnb_tools"],  # the offline tools' entry point: imports the package without its runtime
    # the matrix passed on 3.11 and 3.12; on 3.10 the test extra cannot be installed (trl >= 1.16 and transformers 5
    # need 3.11), so nothing there is tested (tools/compat_matrix.md)
    python_requires=">=3.11",
    install_requires=[
        # exactly the tested releases (deepspeed_bnb/_versions.py, which refuses others at import: it overrides
        # ZeRO internals): every DeepSpeed release from 0.16.4 to 0.19.8, bitsandbytes 0.49.1, 0.49.2 and 0.50.2,
        # torch 2.6 to 2.15 (tools/compat_matrix.md); torch is not installed by this requirement when one
        # is there (install the build you want first: an unpinned torch from PyPI is a CUDA build)
        "deepspeed>=0.16.4,<=0.19.8",
        "bitsandbytes>=0.49.1,<=0.50.2,!=0.50.0,!=0.50.1",
        "torch>=2.6,<2.16",
        "ninja",
        "packaging",
        "safetensors",
    ],
    extras_require={
        # the real clients: examples/train_accelerate.py, train_hf_trainer.py, train_trl_sft.py and their tests
        "clients": ["accelerate>=1.0", "transformers>=4.45", "trl>=1.16", "datasets"],
        # benchmarks/compare_adam.py draws its plots with matplotlib
        "bench": ["matplotlib"],
        # CI runs the client tests and the benchmark smoke test, so `test` pulls both; `build` makes the sdist and wheel
        "test": ["pytest", "accelerate>=1.0", "transformers>=4.45", "trl>=1.16", "datasets", "matplotlib", "build"],
    },
    entry_points={"console_scripts": ["deepspeed-bnb = deepspeed_bnb_tools:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
