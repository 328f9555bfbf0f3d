"""The CUDA kernels' quantizer (csrc/include/dsbnb/compact_quantizer.h: a 6 KB table in shared memory and one compare)
gives the same code as the searches it replaces: bitsandbytes' quantize_2D (the bnb_cuda arithmetic: ties to the
even sorted index, NaN to entry 0) and the count of midpoints below the value (the ieee arithmetic, ties low).

Checked on the host, where both are plain fp32 compares: tests/native/compact_quantizer_check.cpp, built here with g++,
runs every float within 256 ulps of every midpoint, map value and bucket edge, special values and 2^24 random bit
patterns, for bnb's own two maps (from bitsandbytes) and the project's rebuild of them. The exhaustive run over all 2^32
floats takes minutes: `python tools/compact_quantizer_exhaustive.py`. The same run holds what the kernels' Selects shape
relies on (csrc/cuda/fused_step.cuh: quantize_bnb): the table looked up for a NaN too stays in bounds, 0 chosen for it
after gives quantize_2D's code, and a sorted map's codes with the sign bit set are the first ones (its sign fix reads
the sign off the index). Controls: the wrong tie rule is caught; a count of negative codes one short is caught; the
table's answer kept for a NaN is caught; a map the table cannot serve (unsorted, or with repeated values) is reported
unusable, so the kernels take the literal search for it.
"""


import bitsandbytes.functional as F
import pytest
import torch

from deepspeed_bnb.ops import reference
from support import native_checks

SUMMARY = native_checks.SUMMARY["compact_quantizer_check.cpp"]


def build(out_dir, *defines) -> str:
    # the compiler's default target: the table's arithmetic is plain fp32, the same on every x86-64 CPU
    return native_checks.build_or_skip("compact_quantizer_check.cpp", out_dir, march=None, defines=defines)


def run(binary, qmap: torch.Tensor, signed: bool, tmp_path, mode="near"):
    path = native_checks.write_map(qmap, f"{tmp_path}/map.bin")
    code, found, out = native_checks.run_check(binary, SUMMARY, path, "signed" if signed else "unsigned", mode)
    assert found is not None, out
    return (code, *map(int, found), out)


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("compact")))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("source", ["bitsandbytes", "reference"])
def test_fast_quantizer_equals_the_searches_near_every_edge(checker, tmp_path, signed, source):
    qmap = F.create_dynamic_map(signed=signed) if source == "bitsandbytes" else reference.dynamic_map(signed)
    code, checked, mismatches, usable, entries, signs, out = run(checker, qmap, signed, tmp_path)
    assert usable == 1 and entries <= 8192, out  # bnb's maps take the fast path, within the 8 KB table
    assert checked > (1 << 24) and mismatches == 0 and signs == 0 and code == 0, out


def test_control_the_wrong_tie_rule_is_caught(tmp_path):
    mutant = build(str(tmp_path), "COMPACT_CHECK_MUTANT")
    code, checked, mismatches, usable, _, _, out = run(mutant, F.create_dynamic_map(signed=True), True, tmp_path)
    assert usable == 1 and mismatches > 0 and code == 1, out


def test_control_the_tables_answer_for_a_nan_is_caught(tmp_path):
    mutant = build(str(tmp_path), "COMPACT_CHECK_NAN_MUTANT")
    code, _, mismatches, usable, _, signs, out = run(mutant, F.create_dynamic_map(signed=True), True, tmp_path)
    assert usable == 1 and mismatches > 0 and signs == 0 and code == 1, out


def test_control_a_wrong_count_of_negative_codes_is_caught(tmp_path):
    mutant = build(str(tmp_path), "COMPACT_CHECK_SIGN_MUTANT")
    code, _, mismatches, usable, _, signs, out = run(mutant, F.create_dynamic_map(signed=True), True, tmp_path)
    assert usable == 1 and mismatches == 0 and signs == 1 and code == 1, out


@pytest.mark.parametrize("broken", ["unsorted", "repeated"])
def test_control_a_map_the_table_cannot_serve_is_reported(checker, tmp_path, broken):
    qmap = F.create_dynamic_map(signed=True).clone()
    if broken == "unsorted":
        qmap[[10, 200]] = qmap[[200, 10]]
    else:
        qmap[11] = qmap[10]
    code, checked, _, usable, _, _, out = run(checker, qmap, True, tmp_path)
    assert usable == 0 and checked == 0, out
