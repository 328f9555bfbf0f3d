"""The CPU kernels' per-block helpers are compiled into their block loops, not called: what the library holds.

gcc decides inlining by its own cost model, and twice it chose against the kernels' speed without changing a result:
it kept `dequantize64` and `quantize_full_block` as functions of their own (each call then passed four vectors through
the stack and set its constants up again: the AdamW step ~9% slower), and it deleted every call to a non-inlined
function whose body only prefetches (judged free of effects: no prefetch instruction in the library at all). The
helpers are `always_inline` now; a lost attribute would pass every exactness test, so this test reads the built
library itself (`nm` for functions of those names, `objdump` for prefetch instructions). Speed itself is shown by
benchmarks/bench_optimizer_step.py, never here.
Controls: the reader does find a helper that is meant to stay a function (`block_absmax`, called on the rare NaN
path), so an empty or misread symbol list cannot pass; run on the library built before the attributes, it named
`dequantize64` and `quantize_full_block`.
"""

import re
import shutil
import subprocess

import pytest

from deepspeed_bnb.ops import cpu_features, loader

# the helpers the AVX-512 full-block path must inline (csrc/cpu/adam8bit_avx512.h, master_weights_avx512.h,
# fused_cpu.h)
INLINED = ("dsbnb::avx512::dequantize64", "dsbnb::avx512::quantize16_as", "dsbnb::avx512::quantize_groups_as",
           "dsbnb::avx512::quantize_groups", "dsbnb::cpu::quantize_full_block",
           "dsbnb::cpu::prefetch_block", "dsbnb::cpu::prefetch_lines", "dsbnb::avx512::join16",
           "dsbnb::avx512::split16", "dsbnb::avx512::error_exponent16", "dsbnb::avx512::bf16_round16")
KEPT_AS_FUNCTION = "dsbnb::cpu::block_absmax"  # the control: a helper the kernels call


@pytest.fixture(scope="module")
def library():
    for tool in ("nm", "objdump"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} (binutils) is not installed on this machine")
    if not loader.load():
        pytest.skip(f"the kernels are not built here: {loader.error()}")
    path = loader.built_file()
    if path is None:
        pytest.skip("the operators were registered before the loader ran: no library file to read")
    return path


def defined_functions(path: str) -> set:
    """The demangled names (without their argument lists) of the functions the library defines."""
    listing = subprocess.run(["nm", "-C", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    names = set()
    for line in listing.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in ("t", "T", "w", "W"):
            names.add(re.sub(r"^(?:\S+ )?([\w:]+?)(?:<.*)?\(.*$", r"\1", parts[2]))
    return names


def test_reader_finds_a_helper_kept_as_a_function(library):
    assert KEPT_AS_FUNCTION in defined_functions(library)


def test_full_block_helpers_are_inlined(library):
    if cpu_features.kernel_path(loader.compiled_for() or ()) not in cpu_features.AVX512_PATHS:
        pytest.skip("this build does not compile the AVX-512 full-block path")
    functions = defined_functions(library)
    assert not [name for name in INLINED if name in functions]


def test_block_prefetches_are_compiled_in(library):
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], check=True, capture_output=True,
                                 text=True).stdout
    assert re.search(r"\t(prefetch\w*|prfm)\s", disassembly)  # x86 PREFETCHT0/PREFETCHW, ARM PRFM
