"""The kernels' compensated master weights (csrc/include/dsbnb/master_weights.h: error_unit, join, split, spelled with
integer operations so that the CPU loops vectorize; csrc/cpu/master_weights_avx512.h: join16 and split16, the CPU
kernels' 16-lane spelling where the compiler targets AVX-512; csrc/cpu/master_weights_avx2.h: join8 and split8, their
8-lane one where it targets AVX2) equal their literal definition with frexp/ldexp (deepspeed_bnb/ops/compensated.py),
on the host: error_unit for every finite bf16 value, join for every bf16 value and error byte, split around every bf16
value and for 2^24 random floats (tests/native/master_weights_check.cpp). Controls: a unit off by one exponent for
subnormal weights is caught, and so is a vector split without its clamp."""

import pytest

from support import native_checks


def run(out_dir, *defines):
    binary = native_checks.build_or_skip("master_weights_check.cpp", out_dir, defines=defines)
    code, found, out = native_checks.run_check(binary, native_checks.SUMMARY["master_weights_check.cpp"])
    assert found is not None, out
    return (code, *map(int, found), out)


def vector_spellings_here() -> int:
    """How many vector spellings -march=native compiles here (the loader's rule, cpu_features.kernel_path): the 16-lane
    and the 8-lane one where the kernels' AVX-512 path is compiled, the 8-lane one where the AVX2 path is, else none."""
    from deepspeed_bnb.ops import cpu_features
    path = cpu_features.kernel_path(cpu_features.cpu_has() or ())
    return 2 if path in cpu_features.AVX512_PATHS else 1 if path == cpu_features.AVX2_PATH else 0


def test_compensated_master_weights_equal_the_literal_definition(tmp_path):
    code, checked, mismatches, vector, out = run(str(tmp_path))
    assert checked > 40_000_000 and mismatches == 0 and code == 0, out
    # each vector spelling is checked wherever the kernels compile it, over the same values again
    expected = vector_spellings_here()
    assert vector == expected and 43_000_000 * (1 + expected) > checked > 41_000_000 * (1 + expected), out


def test_control_a_wrong_unit_is_caught(tmp_path):
    code, _, mismatches, _, out = run(str(tmp_path), "MASTER_CHECK_MUTANT")
    assert mismatches > 0 and code == 1, out


def test_control_a_vector_split_without_its_clamp_is_caught(tmp_path):
    if not vector_spellings_here():
        pytest.skip("this CPU has neither AVX-512 F, BW and DQ nor AVX2: the kernels compile no vector spelling here")
    code, _, mismatches, vector, out = run(str(tmp_path), "MASTER_CHECK_VECTOR_MUTANT")
    assert vector == vector_spellings_here() and mismatches > 0 and code == 1, out
