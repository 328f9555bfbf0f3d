"""ZeRO++ hierarchical partitioning (hpZ) with bnb 8-bit state: the runs of tests/support/hpz_scenarios.py, in the
launches shared with test_distributed.py (tests/support/scenario_runs.py).

hpZ 2 at DP 4 tracks DP 1 without hpZ (the same bar as every fp32 configuration); its checkpoint resumes bit for bit
at DP 4 with hpZ 1 and hpZ 4 (the secondary partition size changed), and within the bar at DP 2 with hpZ 2.
Controls: secondary partitions were in use during the run (else hpZ would be tested vacuously); the resume without
optimizer state diverges.
"""

import pytest

from support.hpz_scenarios import REFERENCE, RESUME_HPZ, SAVE_AT
from support.scenario_runs import HPZ_LOAD, HPZ_SAVE, SIZES, hpz_runs

FP32_TOL = 1e-5  # as test_distributed.py: max |loss difference| over the run

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(HPZ_SAVE not in SIZES, reason=f"the hpZ runs need DP {HPZ_SAVE} (scenario sizes "
                                                               f"{SIZES})"),
              pytest.mark.skipif(HPZ_SAVE in SIZES and not hpz_runs(), reason="hpZ with a bnb optimizer is refused "
                                 "before DeepSpeed 0.19.5 (its hpZ partitioning fails on block padding)")]


def apart(a, b) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def saved(scenario_results):
    return scenario_results[HPZ_SAVE]["hpz_save"]


def test_hpz_tracks_single_rank(saved, scenario_results):
    assert saved["secondary_in_use"]  # control: hpZ's secondary partitions were gathered from
    assert apart(saved["losses"], scenario_results[1]["train"][REFERENCE]["losses"]) <= FP32_TOL


@pytest.mark.parametrize("hpz", RESUME_HPZ)
def test_hpz_checkpoint_resumes_bit_for_bit_with_another_hpz_size(saved, hpz):
    resumed = saved["resumed"][str(hpz)]
    assert resumed["losses"] == saved["losses"][SAVE_AT:]
    assert resumed["state_equal"]
    assert apart(saved["state_dropped"], saved["losses"][SAVE_AT:]) > 1e-3  # control: the state is what carried it


def test_hpz_checkpoint_loads_at_another_dp_size(saved, scenario_results):
    loaded = scenario_results[HPZ_LOAD]["hpz_load"]
    assert apart(loaded["losses"], saved["losses"][SAVE_AT:]) <= FP32_TOL
