"""Data-parallel changes under pipeline and tensor parallelism: a checkpoint of 2 pipeline stages (ZeRO-1) or of 2
AutoTP ranks (ZeRO-2) saved at data-parallel size D loads at D' with the same model-parallel layout, D, D' in {1, 2}.

The runs are tests/support/parallel_scenarios.py's, in the launches shared with test_distributed.py
(tests/support/scenario_runs.py: 2 ranks save at DP 1 and load it, 4 ranks save at DP 2 and load both, 2 ranks again
load DP 2). Checks, as the DP-only matrix (test_elastic.py): every (model-parallel rank, parameter)'s codes, absmax,
fp32 moments, step and master weights byte-identical to what was saved, the module's weights the master weights, the
saved lr restored (the loader was built with a 50x larger one), 10 more steps tracking the run that never stopped,
bit-exact at the same size and stage. Control: loading without optimizer state diverges. A change of the pipeline or
tensor-parallel size itself is not covered (refused: docs/limitations.md).
"""

import pytest

from support.parallel_scenarios import LOADER_STAGES, MODEL_PARALLEL, PARALLEL_KINDS
from support.scenario_runs import PARALLEL, SIZES

pytestmark = pytest.mark.multi_rank
FP32_TOL = 1e-5
WORLDS = [w for w in PARALLEL if w in SIZES]
CASES = [(kind, saved // MODEL_PARALLEL, loaded) for kind in PARALLEL_KINDS for saved in WORLDS for loaded in WORLDS]


@pytest.fixture(scope="module")
def runs(scenario_results):
    saves = {world: result["parallel_save"] for world, result in scenario_results.items() if "parallel_save" in result}
    loads = {}
    for world, result in scenario_results.items():
        for key, value in result.get("parallel_load", {}).items():
            kind, saved = key.rsplit("_from", 1)
            loads[(kind, int(saved), world)] = value
    assert sorted(saves) == WORLDS and len(loads) == len(CASES), sorted(loads)
    return saves, loads


@pytest.mark.parametrize("kind,saved_dp,world", CASES)
def test_load_at_another_data_parallel_size(runs, kind, saved_dp, world):
    saves, loads = runs
    run, reference = loads[(kind, saved_dp, world)], saves[saved_dp * MODEL_PARALLEL][kind]["continued"]
    stage = LOADER_STAGES.get(kind, {}).get(world // MODEL_PARALLEL, PARALLEL_KINDS[kind]["stage"])
    assert run["stage"] == stage
    assert run["state_identical"], "per-parameter state or master weights differ from what was saved"
    assert run["weights_follow_master"], "the module's weights are not the loaded master weights"
    assert run["lr"] == [1e-3], "hyper-parameters must come from the checkpoint"
    assert max(abs(a - b) for a, b in zip(run["continued"], reference)) < FP32_TOL, \
        {"continued": run["continued"], "reference": reference}
    assert max(abs(a - b) for a, b in zip(run["state_dropped"], reference)) > 100 * FP32_TOL  # control
    if saved_dp == world // MODEL_PARALLEL and stage == PARALLEL_KINDS[kind]["stage"]:
        assert run["continued"] == reference
