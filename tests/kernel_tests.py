"""The test files that hold each fused update rule's compiled kernels to its pure-torch reference (one file per rule
of deepspeed_bnb/ops/rules.py): tests/test_build.py runs them against setup.py's x86-64-v2 build, and
tests/cuda_kernel_run.py on a GPU (with the first-use check's tests). Importable without DeepSpeed or bitsandbytes."""

RULE_TEST_FILES = ("test_fused_step.py", "test_fused_lion.py", "test_fused_momentum.py")
