"""The AVX-512 dequantizer (csrc/cpu/adam8bit_avx512.h: dequantize64) equals the scalar `qmap[code] * scale` bit for
bit in each spelling this CPU can run: byte permutes (AVX-512 VBMI, this machine's -march=native where it has VBMI)
and 32-entry float permutes (AVX-512 F, BW and DQ only, as on Skylake-SP and Cascade Lake hosts: gcc's x86-64-v4 level),
for bnb's two maps, every code at every position, scales giving normal, subnormal, zero, infinite and NaN products
(tests/native/dequantize_check.cpp). The kernels' own exactness tests run the spelling of this machine's JIT build
only; this is what holds the other one here.
Control: the harness expecting the entry of the code with bit 5 flipped reports mismatches, in either spelling."""


import bitsandbytes.functional as F
import pytest

from support import native_checks
from deepspeed_bnb.ops import cpu_features

# -march -> the spelling it compiles; x86-64-v4 (AVX-512 F, BW, CD, DQ, VL: no VBMI) only where this CPU runs it
SPELLINGS = {"native": {cpu_features.AVX512_VBMI_PATH: "vbmi", cpu_features.AVX512_PATH: "float-permutes"}.get(
    cpu_features.kernel_path(cpu_features.cpu_has() or ()), "none")}
if native_checks.runs_here("x86-64-v4"):
    SPELLINGS["x86-64-v4"] = "float-permutes"
SUMMARY = native_checks.SUMMARY["dequantize_check.cpp"]


def run(binary, signed: bool, tmp_path):
    path = native_checks.write_map(F.create_dynamic_map(signed=signed), f"{tmp_path}/map_{int(signed)}.bin")
    code, found, out = native_checks.run_check(binary, SUMMARY, path)
    assert found is not None, out
    checked, mismatches, spelling = found
    return code, int(checked), int(mismatches), spelling, out


@pytest.mark.parametrize("march", sorted(SPELLINGS))
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dequantize64_equals_the_scalar_product(tmp_path, march, signed):
    if SPELLINGS[march] == "none":
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the build has no dequantize64")
    binary = native_checks.build_or_skip("dequantize_check.cpp", str(tmp_path), march)
    code, checked, mismatches, spelling, out = run(binary, signed, tmp_path)
    assert spelling == SPELLINGS[march], out
    assert code == 0 and mismatches == 0 and checked == 8 * 256 * 64, out


@pytest.mark.parametrize("march", sorted(SPELLINGS))
def test_control_the_wrong_code_is_caught(tmp_path, march):
    if SPELLINGS[march] == "none":
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the build has no dequantize64")
    binary = native_checks.build_or_skip("dequantize_check.cpp", str(tmp_path), march, ["EXPECT_WRONG_CODE"])
    code, checked, mismatches, spelling, out = run(binary, True, tmp_path)
    assert spelling == SPELLINGS[march] and code == 1 and mismatches > checked // 2, out
