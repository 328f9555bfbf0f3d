"""The CPU kernels' quantizers (csrc/cpu/quantize_keys.h: KeyTable, one look-up of the value's top 16 ordered bits and
one integer compare, the ~1/256 values near a midpoint settled by an exact compare; RunTable, one line per run of
evenly spaced midpoints, AVX-512 only, its near values settled by the key table) give the code the literal search
gives: the count of fp32 midpoints below the value (the ieee arithmetic, ops/reference.py), through each of their
spellings this CPU compiles (portable lookup, AVX2 lookup8, AVX-512 quantize16 by the runs and by the gather).

Checked on the host by tests/native/key_table_check.cpp, built here with g++ -march=native: every float within 256 ulps
of every midpoint and map value, 4 ulps of every one of the 65,536 bucket edges, special values and 2^24 random bit
patterns, for bnb's two maps, the project's rebuild of them and maps with a midpoint at zero. The run over all 2^32
floats takes minutes: `key_table_check MAP.bin all`. bnb's maps have runs; maps with a midpoint at zero do not (the key
table steps them). quantize16 is also checked with Adam's floor (floor_positive) and with normalize()'s test skipped.
Controls: the wrong tie rule is caught; runs that settle no value by the key table (band 0) are caught, and so are
lines evaluated past their run's last count (no `top`) and floored codes held to codes without the floor; a map with
two midpoints in one bucket is reported unusable (the kernels then take the generic look-up).
"""


import bitsandbytes.functional as F
import pytest
import torch

from support import native_checks
from deepspeed_bnb.ops import cpu_features, reference

SUMMARY = native_checks.SUMMARY["key_table_check.cpp"]


def build(out_dir, *defines) -> str:
    return native_checks.build_or_skip("key_table_check.cpp", out_dir, defines=defines)


def run(binary, qmap: torch.Tensor, tmp_path):
    code, found, out = native_checks.run_check(binary, SUMMARY, native_checks.write_map(qmap, f"{tmp_path}/map.bin"))
    assert found is not None, out
    return (code, *map(int, found), out)


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("key_table")))


def _maps():
    zero_midpoint = torch.cat([-torch.linspace(1e-3, 1.0, 128).flip(0), torch.linspace(1e-3, 1.0, 128)])
    signed_zeros = F.create_dynamic_map(signed=True).clone()
    signed_zeros[signed_zeros == 1.0] = -0.0  # both zeros among the codes: their midpoint is 0
    return {"bnb signed": F.create_dynamic_map(signed=True), "bnb unsigned": F.create_dynamic_map(signed=False),
            "reference signed": reference.dynamic_map(True), "reference unsigned": reference.dynamic_map(False),
            "midpoint at zero": zero_midpoint, "signed zeros": signed_zeros.sort().values}


# what -march=native compiles quantize16 for (csrc/cpu/adam8bit_avx512.h)
AVX512 = cpu_features.kernel_path(cpu_features.cpu_has() or ()) in cpu_features.AVX512_PATHS
WITH_RUNS = ("bnb signed", "bnb unsigned", "reference signed", "reference unsigned")  # midpoints in evenly spaced runs


@pytest.mark.parametrize("name", list(_maps()))
def test_key_table_equals_the_count_of_midpoints_below(checker, tmp_path, name):
    code, checked, mismatches, usable, runs, paths, out = run(checker, _maps()[name], tmp_path)
    assert usable == 1, out  # these maps take the fast path
    assert runs == (name in WITH_RUNS), out  # a midpoint at zero: no runs (the key table steps the map)
    assert checked > (1 << 24) and mismatches == 0 and code == 0, out
    assert paths >= 2 or not torch.backends.cpu.get_cpu_capability().startswith("AVX"), out


def test_control_the_wrong_tie_rule_is_caught(tmp_path):
    mutant = build(str(tmp_path), "KEY_TABLE_MUTANT")
    code, _, mismatches, usable, _, _, out = run(mutant, F.create_dynamic_map(signed=True), tmp_path)
    assert usable == 1 and mismatches > 0 and code == 1, out


@pytest.mark.parametrize("mutant", ["RUN_TABLE_MUTANT", "RUN_ENDS_MUTANT", "FLOOR_MUTANT", "SIGNLESS_MUTANT"])
def test_control_quantize16_errors_are_caught(tmp_path, mutant):
    # band 0: no value settled by the key table; top +inf: lines past their run's last count; the floor expected
    # nowhere: the floored spellings are checked against it; the spelling without the sign given negative values
    mutant = build(str(tmp_path), mutant)
    code, _, mismatches, _, runs, paths, out = run(mutant, F.create_dynamic_map(signed=False), tmp_path)
    if not AVX512:  # quantize16 is not compiled here: the runs have no spelling to check
        assert paths < 4, out
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the build has no quantize16, whose runs this control checks")
    assert runs == 1 and mismatches > 0 and code == 1, out


def test_control_a_map_with_two_midpoints_in_one_bucket_is_reported(checker, tmp_path):
    qmap = F.create_dynamic_map(signed=True).sort().values
    x = float(qmap[200])  # codes 201 and 202 moved just above code 200: two midpoints 2^-21 and 2^-20 above it
    qmap[201], qmap[202] = x * (1 + 2 ** -20), x * (1 + 2 ** -19)
    assert bool((qmap[1:] > qmap[:-1]).all())
    code, checked, _, usable, _, _, out = run(checker, qmap, tmp_path)
    assert usable == 0 and checked == 0, out
