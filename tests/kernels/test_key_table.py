"""The CPU kernels' quantizer (csrc/cpu/quantize_keys.h: KeyTable, one look-up of the value's top 16 ordered bits and
one integer compare, the ~1/256 values near a midpoint settled by an exact compare) gives the code the literal search
gives: the count of fp32 midpoints below the value (the ieee arithmetic, ops/reference.py), through each of its
spellings this CPU compiles (portable lookup, AVX2 lookup8, AVX-512 quantize16).

Checked on the host by tests/native/key_table_check.cpp, built here with g++ -march=native: every float within 256 ulps
of every midpoint and map value, 4 ulps of every one of the 65,536 bucket edges, special values and 2^24 random bit
patterns, for bnb's two maps, the project's rebuild of them and maps with a midpoint at zero. The run over all 2^32
floats takes minutes: `key_table_check MAP.bin all`. Controls: the wrong tie rule is caught; a map with two midpoints
in one bucket is reported unusable (the kernels then take the generic look-up).
"""

import os
import re
import shutil
import subprocess

import bitsandbytes.functional as F
import pytest
import torch

from conftest import ROOT
from deepspeed_bnb.ops import reference

SOURCE = os.path.join(ROOT, "tests", "native", "key_table_check.cpp")


def build(out_dir, *defines) -> str:
    if not shutil.which("g++"):
        pytest.skip("g++ is not installed on this machine")
    binary = os.path.join(out_dir, "key_table_check" + "".join(d.lower() for d in defines))
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc', 'include')}",
                    f"-I{os.path.join(ROOT, 'csrc', 'cpu')}", *[f"-D{d}" for d in defines], SOURCE, "-o", binary],
                   check=True)
    return binary


def run(binary, qmap: torch.Tensor, tmp_path):
    path = os.path.join(tmp_path, "map.bin")
    qmap.float().contiguous().numpy().tofile(path)
    done = subprocess.run([binary, path], capture_output=True, text=True)
    checked, mismatches, usable, paths = map(int, re.fullmatch(
        r"checked (\d+) mismatches (\d+) usable (\d) paths (\d)", done.stdout.strip().splitlines()[-1]).groups())
    return done.returncode, checked, mismatches, usable, paths, done.stdout


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


@pytest.mark.parametrize("name", list(_maps()))
def test_key_table_equals_the_count_of_midpoints_below(checker, tmp_path, name):
    code, checked, mismatches, usable, paths, out = run(checker, _maps()[name], tmp_path)
    assert usable == 1, out  # these maps take the fast path
    assert checked > (1 << 24) and mismatches == 0 and code == 0, out
    assert paths >= 2 or not torch.backends.cpu.get_cpu_capability().startswith("AVX"), out


def test_control_the_wrong_tie_rule_is_caught(tmp_path):
    mutant = build(str(tmp_path), "KEY_TABLE_MUTANT")
    code, _, mismatches, usable, _, out = run(mutant, F.create_dynamic_map(signed=True), tmp_path)
    assert usable == 1 and mismatches > 0 and code == 1, out


def test_control_a_map_with_two_midpoints_in_one_bucket_is_reported(checker, tmp_path):
    qmap = F.create_dynamic_map(signed=True).sort().values
    x = float(qmap[200])  # codes 201 and 202 moved just above code 200: two midpoints 2^-21 and 2^-20 above it
    qmap[201], qmap[202] = x * (1 + 2 ** -20), x * (1 + 2 ** -19)
    assert bool((qmap[1:] > qmap[:-1]).all())
    code, checked, _, usable, _, out = run(checker, qmap, tmp_path)
    assert usable == 0 and checked == 0, out
