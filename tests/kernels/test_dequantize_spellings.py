"""The AVX-512 dequantizer (csrc/cpu/adam8bit_avx512.h: dequantize64) equals the scalar `qmap[code] * scale` bit for
bit in each spelling this CPU can run: byte permutes (AVX-512 VBMI, this machine's -march=native where it has VBMI)
and 32-entry float permutes (AVX-512 F, BW and DQ only, as on Skylake-SP and Cascade Lake hosts: gcc's x86-64-v4 level),
for bnb's two maps, every code at every position, scales giving normal, subnormal, zero, infinite and NaN products
(tests/native/dequantize_check.cpp). The kernels' own exactness tests run the spelling of this machine's JIT build
only; this is what holds the other one here.
Control: the harness expecting the entry of the code with bit 5 flipped reports mismatches, in either spelling."""

import os
import re
import shutil
import subprocess

import bitsandbytes.functional as F
import pytest

from conftest import ROOT
from deepspeed_bnb.ops import cpu_features

SOURCE = os.path.join(ROOT, "tests", "native", "dequantize_check.cpp")
CPU = cpu_features.cpu_has() or frozenset()
# -march -> the spelling it compiles; x86-64-v4 (AVX-512 F, BW, CD, DQ, VL: no VBMI) only where this CPU runs it
SPELLINGS = {"native": {cpu_features.AVX512_VBMI_PATH: "vbmi", cpu_features.AVX512_PATH: "float-permutes"}.get(
    cpu_features.kernel_path(CPU), "none")}
if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= CPU:
    SPELLINGS["x86-64-v4"] = "float-permutes"


def build(out_dir, march, *defines) -> str:
    if not shutil.which("g++"):
        pytest.skip("g++ is not installed on this machine")
    binary = os.path.join(out_dir, f"dequantize_check_{march}" + "".join(d.lower() for d in defines))
    subprocess.run(["g++", "-O2", f"-march={march}", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
                    f"-I{os.path.join(ROOT, 'csrc', 'cpu')}", *[f"-D{d}" for d in defines], SOURCE, "-o", binary],
                   check=True)
    return binary


def run(binary, signed: bool, tmp_path):
    path = os.path.join(tmp_path, f"map_{int(signed)}.bin")
    F.create_dynamic_map(signed=signed).float().contiguous().numpy().tofile(path)
    done = subprocess.run([binary, path], capture_output=True, text=True)
    checked, mismatches, spelling = re.fullmatch(r"checked (\d+) mismatches (\d+) spelling (\S+)",
                                                 done.stdout.strip().splitlines()[-1]).groups()
    return done.returncode, int(checked), int(mismatches), spelling, done.stdout


@pytest.mark.parametrize("march", sorted(SPELLINGS))
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dequantize64_equals_the_scalar_product(tmp_path, march, signed):
    if SPELLINGS[march] == "none":
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the build has no dequantize64")
    code, checked, mismatches, spelling, out = run(build(str(tmp_path), march), signed, tmp_path)
    assert spelling == SPELLINGS[march], out
    assert code == 0 and mismatches == 0 and checked == 8 * 256 * 64, out


@pytest.mark.parametrize("march", sorted(SPELLINGS))
def test_control_the_wrong_code_is_caught(tmp_path, march):
    if SPELLINGS[march] == "none":
        pytest.skip("this CPU has no AVX-512 F, BW and DQ: the build has no dequantize64")
    code, checked, mismatches, spelling, out = run(build(str(tmp_path), march, "EXPECT_WRONG_CODE"), True, tmp_path)
    assert spelling == SPELLINGS[march] and code == 1 and mismatches > checked // 2, out
