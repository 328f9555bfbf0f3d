"""Child of test_build.py: builds the CPU operators for x86-64-v2 (SSE4.2: no AVX2, no AVX-512, so the portable
loops and KeyTable::lookup run everywhere), registers them before deepspeed_bnb's loader looks, and runs the fused
kernels' bit-identity tests against them. TORCH_EXTENSIONS_DIR (set by the parent) keeps the build apart."""

import os
import sys

import pytest
from torch.utils.cpp_extension import load

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, ROOT)

from deepspeed_bnb.ops import build_flags, loader  # noqa: E402
from kernel_tests import RULE_TEST_FILES  # noqa: E402

flags = ["-O3", "-march=x86-64-v2", "-fopenmp"] + build_flags.EXACT_CPU_FLAGS
load(name="deepspeed_bnb_ops_x86_64_v2", sources=[os.path.join(ROOT, p) for p in build_flags.CPU_SOURCES],
     extra_include_paths=[os.path.join(ROOT, "csrc", "include")], extra_cflags=flags,
     extra_ldflags=build_flags.LINK_FLAGS, is_python_module=False)
# the operators the tests call must be these, not a JIT build of the default flags
assert loader.load() and loader.source() == "already registered", (loader.source(), loader.error())
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-k", "not cuda",
                      *(os.path.join(TESTS, name) for name in RULE_TEST_FILES)]))
