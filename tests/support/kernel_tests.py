"""The test files that hold the fused update rules' compiled kernels to their pure-torch reference: the shared
checks of every rule of deepspeed_bnb/ops/rules.py (test_fused_rules.py) and each rule's own.
tests/kernels/test_build.py runs them against setup.py's x86-64-v2 build, and tests/support/cuda_kernel_run.py on a GPU
(with the first-use check's tests).
Importable without DeepSpeed or bitsandbytes."""

# paths from tests/
RULE_TEST_FILES = tuple(f"kernels/test_fused_{name}.py" for name in ("rules", "adam", "lion", "momentum"))
