"""The host checks of tests/native (key_table_check, dequantize_check, compact_quantizer_check, master_weights_check):
compiled with this machine's C++ compiler for a target, run on a map file, their last line (the summary) matched. Shared
by the kernels' tests, which skip where no compiler is installed, and the GPU proof's part o, which runs them on the GPU
machine's CPU."""

import os
import re
import shutil
import subprocess
from typing import Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "tests", "native")
# each check's summary line (its last): what it checked and how many mismatched first, then what it ran
SUMMARY = {"key_table_check.cpp": r"checked (\d+) mismatches (\d+) usable (\d) runs (\d) paths (\d)",
           "dequantize_check.cpp": r"checked (\d+) mismatches (\d+) spelling (\S+)",
           "compact_quantizer_check.cpp": r"checked (\d+) mismatches (\d+) usable (\d) entries (\d+) signs (\d+)",
           "master_weights_check.cpp": r"checked (\d+) mismatches (\d+) vector (\d) bf16 (\S+)"}


def compiler() -> Optional[str]:
    """The C++ compiler the checks are built with; None where none is installed."""
    return shutil.which("g++") or shutil.which("c++")


def compile_check(source: str, out_dir: str, march: Optional[str] = "native", defines: Sequence[str] = ()) -> str:
    """tests/native/`source` built into out_dir, named after the source, the target and the defines; returns the
    binary's path. march None: the compiler's default target. Raises RuntimeError with the compiler's message."""
    name = os.path.splitext(source)[0] + (f"_{march}" if march else "") + "".join(f"_{d.lower()}" for d in defines)
    binary = os.path.join(out_dir, name)
    done = subprocess.run([compiler() or "g++", "-O2", *([f"-march={march}"] if march else []), "-std=c++17",
                           f"-I{os.path.join(ROOT, 'csrc', 'include')}", f"-I{os.path.join(ROOT, 'csrc', 'cpu')}",
                           *[f"-D{d}" for d in defines], os.path.join(NATIVE, source), "-o", binary],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{source} (-march={march}) did not compile: {done.stderr[-2000:]}")
    return binary


def build_or_skip(source: str, out_dir: str, march: Optional[str] = "native", defines: Sequence[str] = ()) -> str:
    """compile_check for a test: the test skips, saying so, where no C++ compiler is installed."""
    import pytest
    if compiler() is None:
        pytest.skip("no C++ compiler (g++) is installed on this machine")
    return compile_check(source, out_dir, march, defines)


def write_map(qmap, path: str) -> str:
    """The map's 256 values as the float32 file the checks read; returns path."""
    qmap.float().contiguous().numpy().tofile(path)
    return path


def run_check(binary: str, summary: str, *arguments: str):
    """(exit code, the summary's groups or None where the last line does not match `summary` (SUMMARY's), the output
    for a message)."""
    done = subprocess.run([binary, *arguments], capture_output=True, text=True)
    found = re.fullmatch(summary, (done.stdout.strip().splitlines() or [""])[-1])
    return done.returncode, found.groups() if found else None, done.stdout + done.stderr[-2000:]


def runs_here(march: str) -> bool:
    """Whether this CPU runs code built for `march`: the instruction sets the compiler predefines for it against
    /proc/cpuinfo's flags (deepspeed_bnb.ops.cpu_features, as the loader checks a prebuilt build)."""
    from deepspeed_bnb.ops import cpu_features
    has, cxx = cpu_features.cpu_has(), compiler()
    if has is None or cxx is None:
        return False
    try:
        return cpu_features.compiler_needs([f"-march={march}"], cxx) <= has
    except (OSError, subprocess.CalledProcessError):  # the compiler does not know that target
        return False
