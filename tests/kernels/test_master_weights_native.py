"""The kernels' compensated master weights (csrc/include/dsbnb/master_weights.h: error_unit, join, split, spelled with
integer operations so that the CPU loops vectorize; csrc/cpu/master_weights_avx512.h: join16 and split16, the CPU
kernels' 16-lane spelling where the compiler targets AVX-512) equal their literal definition with frexp/ldexp
(deepspeed_bnb/ops/compensated.py), on the host: error_unit for every finite bf16 value, join for every bf16 value and
error byte, split around every bf16 value and for 2^24 random floats (tests/native/master_weights_check.cpp).
Controls: a unit off by one exponent for subnormal weights is caught, and so is a 16-lane split without its clamp."""

import pytest

from support import native_checks


def run(out_dir, *defines):
    binary = native_checks.build_or_skip("master_weights_check.cpp", out_dir, defines=defines)
    code, found, out = native_checks.run_check(binary, native_checks.SUMMARY["master_weights_check.cpp"])
    assert found is not None, out
    return (code, *map(int, found), out)


def avx512_here() -> bool:
    """Whether -march=native compiles the kernels' AVX-512 full-block path here (the loader's rule,
    cpu_features.kernel_path): then the check holds the 16-lane spelling too."""
    from deepspeed_bnb.ops import cpu_features
    return cpu_features.kernel_path(cpu_features.cpu_has() or ()) in cpu_features.AVX512_PATHS


def test_compensated_master_weights_equal_the_literal_definition(tmp_path):
    code, checked, mismatches, vector, out = run(str(tmp_path))
    assert checked > 40_000_000 and mismatches == 0 and code == 0, out
    # the 16-lane spelling is checked wherever the kernels compile it: twice the values
    assert vector == int(avx512_here()) and (checked > 80_000_000) == bool(vector), out


def test_control_a_wrong_unit_is_caught(tmp_path):
    code, _, mismatches, _, out = run(str(tmp_path), "MASTER_CHECK_MUTANT")
    assert mismatches > 0 and code == 1, out


def test_control_a_16_lane_split_without_its_clamp_is_caught(tmp_path):
    if not avx512_here():
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the kernels do not compile the 16-lane spelling here")
    code, _, mismatches, vector, out = run(str(tmp_path), "MASTER_CHECK_VECTOR_MUTANT")
    assert vector == 1 and mismatches > 0 and code == 1, out
