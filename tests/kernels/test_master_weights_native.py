"""The kernels' compensated master weights (csrc/include/dsbnb/master_weights.h: error_unit, join, split, spelled with
integer operations so that the CPU loops vectorize; csrc/cpu/master_weights_avx512.h: join16 and split16, the CPU
kernels' 16-lane spelling where the compiler targets AVX-512; csrc/cpu/master_weights_avx2.h: join8 and split8, their
8-lane one where it targets AVX2) equal their literal definition with frexp/ldexp (deepspeed_bnb/ops/compensated.py),
on the host: error_unit for every finite bf16 value, join for every bf16 value and error byte, split around every bf16
value and for 2^24 random floats (tests/native/master_weights_check.cpp); the 16-lane bf16 rounding of bf16 master
weights and of the model's bf16 copy (bf16_bits16: VCVTNEPS2BF16 where the compiler targets AVX512_BF16) equals the
scalar bf16_round for every float. Controls: a unit off by one exponent for subnormal weights is caught, and so are a
vector split without its clamp and a bf16 rounding without its answer for NaN and subnormal floats."""

import pytest

from support import native_checks


def run(out_dir, *defines):
    binary = native_checks.build_or_skip("master_weights_check.cpp", out_dir, defines=defines)
    code, found, out = native_checks.run_check(binary, native_checks.SUMMARY["master_weights_check.cpp"])
    assert found is not None, out
    return (code, *map(int, found[:-1]), found[-1], out)


def vector_spellings_here() -> int:
    """How many vector spellings -march=native compiles here (the loader's rule, cpu_features.kernel_path): the 16-lane
    and the 8-lane one where the kernels' AVX-512 path is compiled, the 8-lane one where the AVX2 path is, else none."""
    from deepspeed_bnb.ops import cpu_features
    path = cpu_features.kernel_path(cpu_features.cpu_has() or ())
    return 2 if path in cpu_features.AVX512_PATHS else 1 if path == cpu_features.AVX2_PATH else 0


def bf16_spelling_here() -> str:
    """The bf16 rounding spelling -march=native compiles here: VCVTNEPS2BF16 on the AVX-512 path where the compiler
    targets AVX512_BF16 (the CPU has it and the compiler knows it: gcc 10 and later), the integer one on the AVX-512
    path without it, none (the compiler's loop) elsewhere."""
    from deepspeed_bnb.ops import cpu_features
    if cpu_features.kernel_path(cpu_features.cpu_has() or ()) not in cpu_features.AVX512_PATHS:
        return "none"
    needs = cpu_features.compiler_needs(["-march=native"], native_checks.compiler())
    return "vcvtneps2bf16" if "avx512_bf16" in needs else "integer"


def test_compensated_master_weights_equal_the_literal_definition(tmp_path):
    code, checked, mismatches, vector, bf16, out = run(str(tmp_path))
    assert checked > 40_000_000 and mismatches == 0 and code == 0, out
    # each vector spelling is checked wherever the kernels compile it, over the same values again
    expected = vector_spellings_here()
    assert vector == expected and 43_000_000 * (1 + expected) > checked > 41_000_000 * (1 + expected), out
    assert bf16 == bf16_spelling_here(), out


def test_control_a_wrong_unit_is_caught(tmp_path):
    code, _, mismatches, _, _, out = run(str(tmp_path), "MASTER_CHECK_MUTANT")
    assert mismatches > 0 and code == 1, out


def test_control_a_vector_split_without_its_clamp_is_caught(tmp_path):
    if not vector_spellings_here():
        pytest.skip("this CPU has neither AVX-512 F, BW and DQ nor AVX2: the kernels compile no vector spelling here")
    code, _, mismatches, vector, _, out = run(str(tmp_path), "MASTER_CHECK_VECTOR_MUTANT")
    assert vector == vector_spellings_here() and mismatches > 0 and code == 1, out


def test_control_a_bf16_rounding_without_its_nan_and_subnormal_answer_is_caught(tmp_path):
    code, _, mismatches, _, bf16, out = run(str(tmp_path), "MASTER_CHECK_BF16_MUTANT")  # skips without a compiler
    expected = bf16_spelling_here()
    if expected == "none":
        pytest.skip("this CPU lacks AVX-512 F, BW and DQ: the kernels round to bf16 in the compiler's loop here")
    # NaNs (and, for VCVTNEPS2BF16, subnormals): 2^24 - 2 of each
    assert bf16 == expected and mismatches > 16_000_000 and code == 1, out
