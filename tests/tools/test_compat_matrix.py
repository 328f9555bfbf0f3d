"""The compatibility matrix's own decisions, without running a cell (tools/compat_matrix.py): which results count as
done for `--resume --since`, and which claims are n/a for a DeepSpeed release (tests/support/release_limits.py, the
definition test_nvme.py skips by)."""

import importlib.util
import os
import subprocess

import pytest

from conftest import ROOT
from support import release_limits


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("compat_matrix", os.path.join(ROOT, "tools", "compat_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit(rev):
    done = subprocess.run(["git", "rev-parse", "--short", rev], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        pytest.skip(f"no git history here ({done.stderr.strip()})")
    return done.stdout.strip()


def test_since_counts_results_at_the_commit_or_later_only(matrix):
    head, parent = commit("HEAD"), commit("HEAD~1")
    assert matrix.tested_since({"commit": head}, parent)
    assert matrix.tested_since({"commit": head}, head)
    assert not matrix.tested_since({"commit": parent}, head)  # control: an older result is not done
    assert not matrix.tested_since({"commit": head + "-dirty"}, parent)  # what a dirty tree tested is in no history
    assert matrix.tested_since({"commit": parent}, "")  # without --since every result counts
    with pytest.raises(SystemExit, match="--since no-such-commit: not a commit"):
        matrix.tested_since({"commit": head}, "no-such-commit")


def test_nvme_claims_are_na_exactly_where_the_tests_skip_by_release(matrix):
    first = release_limits.FIRST_CPU_SWAPPING
    ids, why = matrix.deepspeed_cannot("0.16.4")
    assert set(ids) == set(matrix.CLAIMS["NVMe offload (ZeRO-3)"]) and first in why
    assert matrix.deepspeed_cannot(first) == ((), "")
    assert matrix.deepspeed_cannot(matrix.MASTER) == ((), "")
    assert matrix.deepspeed_cannot("0.19.7")[0] and not matrix.deepspeed_cannot("0.19.10")[0]
    assert matrix.release("0.20.0rc1") is None  # pre-releases stay out of the default cells
    with open(os.path.join(ROOT, "tests", "support", "async_io.py")) as f:  # the NVMe tests' skip
        assert "from support.release_limits import FIRST_CPU_SWAPPING" in f.read()  # one definition for both
