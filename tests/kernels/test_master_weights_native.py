"""The kernels' compensated master weights (csrc/include/dsbnb/master_weights.h: error_unit, join, split, spelled with
integer operations so that the CPU loops vectorize) equal their literal definition with frexp/ldexp
(deepspeed_bnb/ops/compensated.py), on the host: error_unit for every finite bf16 value, join for every bf16 value and
error byte, split around every bf16 value and for 2^24 random floats (tests/native/master_weights_check.cpp).
Control: a unit off by one exponent for subnormal weights is caught."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT

SOURCE = os.path.join(ROOT, "tests", "native", "master_weights_check.cpp")


def run(out_dir, *defines):
    if not shutil.which("g++"):
        pytest.skip("g++ is not installed on this machine")
    binary = os.path.join(out_dir, "master_weights_check" + "".join(d.lower() for d in defines))
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
                    *[f"-D{d}" for d in defines], SOURCE, "-o", binary], check=True)
    done = subprocess.run([binary], capture_output=True, text=True)
    checked, mismatches = map(int, re.fullmatch(r"checked (\d+) mismatches (\d+)",
                                                done.stdout.strip().splitlines()[-1]).groups())
    return done.returncode, checked, mismatches, done.stdout


def test_compensated_master_weights_equal_the_literal_definition(tmp_path):
    code, checked, mismatches, out = run(str(tmp_path))
    assert checked > 40_000_000 and mismatches == 0 and code == 0, out


def test_control_a_wrong_unit_is_caught(tmp_path):
    code, _, mismatches, out = run(str(tmp_path), "MASTER_CHECK_MUTANT")
    assert mismatches > 0 and code == 1, out
