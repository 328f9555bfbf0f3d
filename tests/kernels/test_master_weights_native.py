"""The kernels' compensated master weights (csrc/include/dsbnb/master_weights.h: error_unit, join, split, spelled with
integer operations so that the CPU loops vectorize) equal their literal definition with frexp/ldexp
(deepspeed_bnb/ops/compensated.py), on the host: error_unit for every finite bf16 value, join for every bf16 value and
error byte, split around every bf16 value and for 2^24 random floats (tests/native/master_weights_check.cpp).
Control: a unit off by one exponent for subnormal weights is caught."""

from support import native_checks


def run(out_dir, *defines):
    binary = native_checks.build_or_skip("master_weights_check.cpp", out_dir, defines=defines)
    code, found, out = native_checks.run_check(binary, native_checks.SUMMARY["master_weights_check.cpp"])
    assert found is not None, out
    return (code, *map(int, found), out)


def test_compensated_master_weights_equal_the_literal_definition(tmp_path):
    code, checked, mismatches, out = run(str(tmp_path))
    assert checked > 40_000_000 and mismatches == 0 and code == 0, out


def test_control_a_wrong_unit_is_caught(tmp_path):
    code, _, mismatches, out = run(str(tmp_path), "MASTER_CHECK_MUTANT")
    assert mismatches > 0 and code == 1, out
