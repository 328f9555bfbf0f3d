"""Which x86 instruction sets a CPU build of the operators needs, and whether this CPU has them (importable without
torch, for setup.py).

Why: the CPU kernels are compiled with -march=native by default, so a build runs only on CPUs with the builder's
instruction sets. Two ordinary setups moved such builds to other CPUs, where the first step dies with SIGILL (no
Python error, no warning): a prebuilt `deepspeed_bnb._C` baked into a container image on one machine and run on
another, and the JIT cache under a home directory that a heterogeneous cluster shares (torch's JIT reuses a build when
the sources and flags match, and "-march=native" reads the same on every node; DeepSpeed's own JIT ops share the
hazard). The loader therefore (1) refuses a prebuilt build whose recorded needs this CPU lacks, and (2) names the JIT
build after the target the compiler resolves -march=native to, so each kind of CPU gets its own cached build.

The needs are read from the compiler itself (`c++ <flags> -dM -E`: the predefined __AVX2__-style macros), and
compared with the "flags" line of /proc/cpuinfo. Only the x86 instruction-set macros in ISA_MACROS are checked
(their /proc/cpuinfo names are not uniform); on other CPUs (ARM) and systems without /proc/cpuinfo a prebuilt build
cannot be checked and is not refused, while the JIT naming covers every target macro.
"""

import hashlib
import os
import re
import shlex
import subprocess
from typing import FrozenSet, Iterable, List, Optional

# compiler macro (without the underscores around it) -> the flag /proc/cpuinfo shows for that instruction set
ISA_MACROS = {
    "SSE3": "pni", "SSSE3": "ssse3", "SSE4_1": "sse4_1", "SSE4_2": "sse4_2", "POPCNT": "popcnt",
    "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI": "bmi1", "BMI2": "bmi2", "LZCNT": "abm",
    "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512DQ": "avx512dq", "AVX512VL": "avx512vl",
    "AVX512CD": "avx512cd", "AVX512VBMI": "avx512vbmi", "AVX512VBMI2": "avx512_vbmi2",
    "AVX512VNNI": "avx512_vnni", "AVX512BF16": "avx512_bf16", "AVX512FP16": "avx512_fp16",
    "AVX512IFMA": "avx512ifma", "AVX512BITALG": "avx512_bitalg", "AVX512VPOPCNTDQ": "avx512_vpopcntdq",
    "AVXVNNI": "avx_vnni", "GFNI": "gfni",
}
# flags that choose the target; the rest of a build's flags (-O3, -fopenmp, ...) do not change what it needs
_TARGET_FLAG = re.compile(r"^-m(arch|tune|cpu|avx|sse|fma|f16c|bmi|popcnt|lzcnt|gfni|no-)")
ISA_FILE = "_C_isa.txt"  # written next to the prebuilt extension by setup.py: one /proc/cpuinfo flag per line


def compiler_macros(flags: Iterable[str], compiler: Optional[str] = None) -> str:
    """The macros the compiler predefines for `flags`' target, sorted (raises if the compiler cannot run)."""
    # CXX as torch's JIT reads it, which may carry a launcher ("ccache g++")
    command = [*shlex.split(compiler or os.environ.get("CXX", "c++")), *(f for f in flags if _TARGET_FLAG.match(f)),
               "-dM", "-E", "-x", "c++", os.devnull]
    return "\n".join(sorted(subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()))


def needs_of(macros: str) -> FrozenSet[str]:
    """The /proc/cpuinfo flags that code compiled with these predefined macros may use."""
    defined = set(re.findall(r"#define __(\w+?)__ 1", macros))
    return frozenset(flag for macro, flag in ISA_MACROS.items() if macro in defined)


def compiler_needs(flags: Iterable[str], compiler: Optional[str] = None) -> FrozenSet[str]:
    """The /proc/cpuinfo flags that code compiled with `flags` may use (raises if the compiler cannot run)."""
    return needs_of(compiler_macros(flags, compiler))


AVX512_VBMI_PATH = "AVX-512 VBMI path"
AVX512_PATH = "AVX-512 path (no VBMI)"
AVX512_PATHS = (AVX512_VBMI_PATH, AVX512_PATH)  # the builds that compile the AVX-512 full-block path
AVX2_PATH = "AVX2 path"


def kernel_path(needs: Iterable[str]) -> str:
    """Which full-block path a build that may use these instruction sets runs: csrc/cpu/adam8bit_avx512.h needs
    AVX-512 F, BW and DQ (its dequantizer byte permutes where VBMI is there too, float permutes elsewhere),
    quantize_keys.h's 8-lane look-up AVX2; without either, the portable loops."""
    needs = frozenset(needs)
    if {"avx512f", "avx512bw", "avx512dq"} <= needs:
        return AVX512_VBMI_PATH if "avx512vbmi" in needs else AVX512_PATH
    return AVX2_PATH if "avx2" in needs else "portable loops"


def cpu_has() -> Optional[FrozenSet[str]]:
    """This CPU's instruction-set flags from /proc/cpuinfo; None where there is no such file (not checked there)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def missing(needs: Iterable[str], has: Optional[FrozenSet[str]] = None) -> List[str]:
    """The needed instruction sets this CPU lacks, sorted (empty when it has them all, or when it cannot tell)."""
    has = cpu_has() if has is None else has
    return [] if has is None else sorted(set(needs) - has)


def build_tag(macros: str) -> str:
    """A short name for a compiler target: part of the JIT build's name, so CPUs that differ get separate builds.
    All the predefined macros count, not only ISA_MACROS: every instruction-set extension the compiler knows (ARM's
    __ARM_FEATURE_SVE too), the tuning target and the compiler version."""
    return hashlib.sha256(macros.encode()).hexdigest()[:10]


def read_needs(extension_path: str) -> Optional[FrozenSet[str]]:
    """What setup.py recorded beside a prebuilt extension (None: nothing recorded, e.g. a build by an older version)."""
    path = os.path.join(os.path.dirname(extension_path), ISA_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return frozenset(line.strip() for line in f if line.strip())


def write_needs(extension_path: str, needs: Iterable[str]) -> str:
    path = os.path.join(os.path.dirname(extension_path), ISA_FILE)
    with open(path, "w") as f:
        f.write("".join(f"{flag}\n" for flag in sorted(needs)))
    return path
