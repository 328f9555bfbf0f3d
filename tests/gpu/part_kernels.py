"""GPU proof, part a: the fused kernels (AdamW, Lion, SGD-momentum) build on the device, equal their pure-torch
reference bit for bit there, and pass the first-use check the ZeRO optimizer runs before its first step.

Reference: deepspeed_bnb/ops/reference.py (pure torch, run on the CPU by the tests' harness and by the first-use check).
The kernel-vs-reference tests are the suite's own (tests/kernel_tests.py lists the files), selected for the device
(`-k cuda_kernel`; the rehearsal selects `cpu_kernel`); a run where none of them ran fails.
"""

import os
import time

import proof_common as common


class Outcomes:
    """A pytest plugin counting the selected tests' outcomes and naming the failures."""

    def __init__(self):
        self.passed, self.skipped, self.failed = 0, 0, []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed += 1
        elif report.skipped:
            self.skipped += 1
        elif report.failed:
            self.failed.append(report.nodeid.split("::")[-1])


def body(args, result):
    import pytest
    import torch

    from deepspeed_bnb.ops import loader, rules, self_check
    from kernel_tests import RULE_TEST_FILES

    start = time.monotonic()
    loaded = loader.load(verbose=False)
    built = time.monotonic() - start
    cuda_in_build = torch.version.cuda is not None and torch.cuda.is_available()
    result.check("the fused kernels build and load", loaded,
                 f"{loader.source() or 'not loaded'} in {built:.0f} s (CUDA sources "
                 f"{'in' if cuda_in_build else 'not in'} "
                 f"the build)" + ("" if loaded else f": {loader.error()}"), "loaded")
    if not loaded:
        return
    outcomes = Outcomes()
    files = [os.path.join(common.TESTS, name) for name in (*RULE_TEST_FILES, "test_self_check.py")]
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", f"{args.device}_kernel", "-rs", *files],
                       plugins=[outcomes])
    result.check(f"kernel == reference, bit for bit, on {args.device} (the suite's {args.device}_kernel tests)",
                 code == 0 and outcomes.passed > 0 and not outcomes.failed,
                 f"{outcomes.passed} passed, {len(outcomes.failed)} failed, {outcomes.skipped} skipped"
                 + (f" (failed: {', '.join(outcomes.failed[:8])})" if outcomes.failed else ""),
                 "all pass, at least one ran")
    for rule in rules.RULES:
        problem = self_check.disagreement(rule, torch.device(args.device))
        result.check(f"first-use check of the {rule} kernel on {args.device}", problem is None,
                     problem or "kernel == reference on the check partition", "no difference, no exception")


if __name__ == "__main__":
    common.run_part("a", "fused kernels against their reference", body)
