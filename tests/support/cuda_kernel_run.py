"""The fused kernels' device checks where DeepSpeed or bitsandbytes is missing: a GPU machine (torch with CUDA,
nvcc and ninja are there; DeepSpeed is not, and bitsandbytes' wheel is larger than what may be carried there).

    python tests/support/cuda_kernel_run.py                # kernel == reference, bit for bit, on the GPU (AdamW,
                                                           # Lion, momentum)
    python tests/support/cuda_kernel_run.py --bench        # then benchmarks/bench_cuda_step.py's table
    python tests/support/cuda_kernel_run.py --device cpu   # the same harness on the CPU kernels
                                                           # (tests/kernels/test_build.py runs it)

bitsandbytes itself can travel too, trimmed to one CUDA library (~5 MB of its 125): here, `python
tests/support/cuda_kernel_run.py --bundle .device` (the GPU machines' torch is built for CUDA 13.0: --cuda 130, the
default); there, carry `.device` and add `--site .device/site`. Then the bench's bnb rows run bnb's own CUDA kernels.

The kernels and their reference need only torch, so where the real packages are missing (or are named in
DSBNB_STAND_INS, e.g. "deepspeed,bitsandbytes"):
- the deepspeed_bnb package is registered without running its __init__, which installs the DeepSpeed integration and
  refuses to import without DeepSpeed and bitsandbytes;
- a stand-in `bitsandbytes` with only functional.create_dynamic_map (reference.dynamic_map, held to bnb's bit for bit
  by tests/kernels/test_fused_adam.py) takes bitsandbytes' place: the selected tests use nothing else of it.
Then it runs the kernel-vs-reference tests of the fused rules' test files (kernel_tests.py) for the device and the
first-use check the ZeRO optimizer runs there (test_self_check.py), and fails when none ran (a machine without a GPU
skips them all).
"""

import argparse
import importlib.util
import os
import sys
import types

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, ROOT)  # deepspeed_bnb, where it is not installed


def bundle(folder: str, cuda: str) -> None:
    """Copies the installed bitsandbytes into folder/site without the native libraries of other CUDA versions, ROCm
    and XPU (pure Python plus one CUDA and the CPU library: small enough to carry to the GPU machine)."""
    sys.path.append(os.path.join(TESTS, "gpu"))
    import bitsandbytes
    from proof_bundle import SITE, trimmed_bitsandbytes
    size = trimmed_bitsandbytes(folder, cuda)
    print(f"bitsandbytes {bitsandbytes.__version__} -> {os.path.join(folder, SITE)} ({size / 1e6:.1f} MB)")


def install_stand_ins(force: list) -> list:
    """Makes deepspeed_bnb.ops importable without DeepSpeed or bitsandbytes; returns what it stood in for."""
    missing = [name for name in ("deepspeed", "bitsandbytes")
               if name in force or importlib.util.find_spec(name) is None]
    if missing:
        package = types.ModuleType("deepspeed_bnb")
        package.__path__ = [os.path.join(ROOT, "deepspeed_bnb")]
        sys.modules["deepspeed_bnb"] = package
    if "bitsandbytes" in missing:
        from deepspeed_bnb.ops import reference
        functional = types.ModuleType("bitsandbytes.functional")
        functional.create_dynamic_map = lambda signed=True: reference.dynamic_map(signed)
        stand_in = types.ModuleType("bitsandbytes")
        stand_in.functional, stand_in.__version__ = functional, "stand-in (tests/support/cuda_kernel_run.py)"
        sys.modules["bitsandbytes"], sys.modules["bitsandbytes.functional"] = stand_in, functional
    return missing


class Counter:
    """A pytest plugin that counts the tests that passed (a run that skipped everything must not pass)."""

    passed = 0

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.passed:
            self.passed += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--bench", action="store_true", help="then run benchmarks/bench_cuda_step.py (cuda only)")
    parser.add_argument("--bundle", metavar="DIR", help="only write DIR/site/bitsandbytes (trimmed) to carry there")
    parser.add_argument("--cuda", default="130", help="with --bundle: the CUDA version of the library to keep")
    parser.add_argument("--site", metavar="DIR", help="import packages from DIR first (a carried bundle's site)")
    args = parser.parse_args()
    if args.bundle:
        return bundle(args.bundle, args.cuda)
    if args.site:
        sys.path.insert(0, os.path.abspath(args.site))
    stood_in = install_stand_ins(force=os.environ.get("DSBNB_STAND_INS", "").split(","))
    import bitsandbytes
    print(f"stand-ins for: {', '.join(stood_in) or 'nothing (the real packages are installed)'}; bitsandbytes "
          f"{bitsandbytes.__version__} from {getattr(bitsandbytes, '__file__', None)}", flush=True)
    from deepspeed_bnb.ops import loader
    if not loader.load(verbose=True):
        sys.exit(f"the fused kernels could not be built: {loader.error()}")
    counter = Counter()
    selected = f"{args.device}_kernel"
    from support.kernel_tests import RULE_TEST_FILES
    files = (*RULE_TEST_FILES, "kernels/test_self_check.py")
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-k", selected, "-rs",
                        *(os.path.join(TESTS, name) for name in files)], plugins=[counter])
    print(f"{counter.passed} kernel-vs-reference tests passed on {args.device}", flush=True)
    if code != 0 or counter.passed == 0:
        sys.exit(code or "no test ran (no such device here?)")
    if "deepspeed" in stood_in:  # the claim this harness rests on: the kernels and reference need only torch
        assert "deepspeed" not in sys.modules, "deepspeed_bnb.ops imported DeepSpeed"
    if args.bench:
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import bench_cuda_step
        sys.argv = [sys.argv[0]]
        bench_cuda_step.main()


if __name__ == "__main__":
    main()
