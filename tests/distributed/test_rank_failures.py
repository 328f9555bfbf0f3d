"""One rank's failure fails every rank, promptly, and costs nothing (2 CPU ranks, tests/support/distributed_scenarios.py
`rank_failures`, in the launch shared with test_distributed.py):
- a load step that fails on rank 1 alone (an I/O error reading a file only it reads): both ranks raise the same
  error naming rank 1, neither engine changed, the next load works;
- a save whose write fails on rank 1 alone (the file size limit, EFBIG: a disk that filled up under that rank): both
  ranks raise the same CheckpointSaveError naming the rank and the file; `latest` still names the previous tag, no
  staging directory is left, the new tag does not exist;
- a publish that fails on rank 0 (no space for the manifest), and a save while another process holds the save
  directory's lock: the same, on both ranks;
- then a save works and loads back bit for bit.
Negative control: in each case the failure was injected on one rank only, so the other rank's error can only come
from the agreement (its message names the failing rank). A hang instead would end the launch by its timeout.
"""

import pytest

from support.scenario_runs import SIZES, SIZES_ENV

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(2 not in SIZES, reason=f"{SIZES_ENV} leaves out the 2-rank launch these tests read")]


@pytest.fixture(scope="module")
def run(scenario_results):
    return scenario_results[2]["rank_failures"]


def same_everywhere(outcomes):
    return len(set(outcomes)) == 1 and len(outcomes) == 2


def test_a_load_failing_on_one_rank_fails_on_both(run):
    case = run["load_io_error"]
    first = case["outcomes"][0]
    assert same_everywhere(case["outcomes"]), case["outcomes"]
    assert first.startswith("CheckpointMismatchError: load_checkpoint(") and "rank 1: OSError: [Errno 5]" in first
    assert case["unchanged"], "a failed load changed an engine"
    assert case["then_loads"] == ["ok", "ok"]


def test_a_write_failing_on_one_rank_fails_the_save_on_both(run):
    case = run["write_too_large"]
    first = case["outcomes"][0]
    assert same_everywhere(case["outcomes"]), case["outcomes"]
    assert first.startswith(f"{run['save_error_class']}: save_checkpoint(") and "rank 1: writing " in first, first
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt failed" in first and "bytes are free" in first, first
    assert "Nothing was saved on any rank" in first
    assert case["latest"] == "good" and case["leftovers"] == [] and not case["next_exists"], case


@pytest.mark.parametrize("name,needle", [("publish_fails", "failed while publishing: rank 0: OSError: [Errno 28]"),
                                         ("locked", "rank 0: another process is saving into")])
def test_publish_and_lock_failures_fail_on_both(run, name, needle):
    case = run[name]
    assert same_everywhere(case["outcomes"]), case["outcomes"]
    assert case["outcomes"][0].startswith(f"{run['save_error_class']}: save_checkpoint(") and \
        needle in case["outcomes"][0], case["outcomes"][0]
    assert case["latest"] == "good"
    assert case.get("leftovers", []) == []


def test_the_next_save_works(run):
    assert run["then_saves"] == ["ok", "ok"] and run["then_saves_latest"] == "next"
    assert run["then_loads_exactly"]
