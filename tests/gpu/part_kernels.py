"""GPU proof, part a: the fused kernels (AdamW, Lion, SGD-momentum) build on the device, equal their oracles bit for
bit there in both arithmetics, and pass the first-use check the ZeRO optimizer runs before its first step.

References: the ieee arithmetic against deepspeed_bnb/ops/reference.py (pure torch, run on the CPU by the tests'
harness); the bnb_cuda arithmetic (what the ZeRO step runs on a GPU) against bitsandbytes' own CUDA update on the same
GPU (ops/bnb_update.py; tests/kernels/test_fused_bnb_cuda.py: every rule, fp32/bf16/compensated master weights, odd
sizes, NaN/Inf gradients, ten steps each); the model's bf16 copy the kernels write beside fp32 master weights against
torch's own conversion on the device, bit for bit (tests/kernels/test_model_copy.py), and the first-use check of it. The
tests are the suite's own (tests/support/kernel_tests.py lists the files), selected for the device (`-k cuda_kernel`;
the rehearsal selects `cpu_kernel`, and has no bnb_cuda kernels to hold to bnb); a run where none of them ran fails.
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
    from support.kernel_tests import RULE_TEST_FILES

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
    files = [os.path.join(common.TESTS, name) for name in (*RULE_TEST_FILES, "kernels/test_self_check.py",
                                                           "kernels/test_model_copy.py")]
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", f"{args.device}_kernel", "-rs", *files],
                       plugins=[outcomes])
    result.check(f"ieee kernels == reference, bit for bit, on {args.device} (the suite's {args.device}_kernel tests; "
                 f"with them the model's copy against torch's conversion)",
                 code == 0 and outcomes.passed > 0 and not outcomes.failed,
                 f"{outcomes.passed} passed, {len(outcomes.failed)} failed, {outcomes.skipped} skipped"
                 + (f" (failed: {', '.join(outcomes.failed[:8])})" if outcomes.failed else ""),
                 "all pass, at least one ran")
    if args.device == "cuda":
        outcomes = Outcomes()
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", "cuda_kernel", "-rs",
                            os.path.join(common.TESTS, "kernels", "test_fused_bnb_cuda.py")], plugins=[outcomes])
        result.check("bnb_cuda kernels == bitsandbytes' own CUDA update, bit for bit, ten steps per partition "
                     "(tests/kernels/test_fused_bnb_cuda.py)",
                     code == 0 and outcomes.passed > 0 and not outcomes.failed,
                     f"{outcomes.passed} passed, {len(outcomes.failed)} failed, {outcomes.skipped} skipped"
                     + (f" (failed: {', '.join(outcomes.failed[:8])})" if outcomes.failed else ""),
                     "all pass, at least one ran")
    else:
        result.note("the bnb_cuda arithmetic exists on CUDA only: its kernels are held to bnb on the GPU")
    oracle = "bnb's own update on the device" if args.device == "cuda" else "the reference"
    for rule in rules.RULES:
        for master in self_check.MASTERS:
            problem = self_check.disagreement(rule, torch.device(args.device), master)
            result.check(f"first-use check of the {rule} kernel on {args.device}, {master} master weights",
                         problem is None, problem or f"kernel == {oracle} on the check partition",
                         "no difference, no exception")
        # the model's bf16 copy beside fp32 master weights (DEEPSPEED_BNB_KERNEL_LP_COPY=gpu on a GPU)
        problem = self_check.disagreement(rule, torch.device(args.device), "fp32", lp_copy=True)
        result.check(f"first-use check of the {rule} kernel's model copy on {args.device} (bf16, fp32 master weights)",
                     problem is None, problem or f"kernel == {oracle}, its copy == torch's conversion",
                     "no difference, no exception")


if __name__ == "__main__":
    common.run_part("a", "fused kernels against their reference", body)
