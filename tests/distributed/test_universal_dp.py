"""Universal checkpoints at another data-parallel size: the DP-1 checkpoints of ZeRO-1 and ZeRO-3 runs, exported as
8-bit universal checkpoints, loaded at DP 2 (ZeRO-2) by engines of deepspeed_bnb with `"checkpoint":
{"load_universal": true}` (tests/support/distributed_scenarios.py's universal_load, in the launches shared with
test_distributed.py).

Against the checkpoint itself and the ordinary load of it: every parameter's codes, absmax, fp32 moments and master
weights identical to what was saved, the saved lr restored (the loader was built with a 50x larger one), and the next
10 steps exactly those of the same checkpoint loaded at DP 2 without the universal detour (elastic_load, which
test_elastic.py holds to the uninterrupted run). Control: the stock kind of universal checkpoint (fp32 moments,
quantized again at load) does not give the saved state.
"""

import pytest

from support.distributed_scenarios import LOADER_STAGES, UNIVERSAL_KINDS
from support.scenario_runs import SIZES, UNIVERSAL_LOAD

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(UNIVERSAL_LOAD not in SIZES, reason=f"needs DP {UNIVERSAL_LOAD} (scenario sizes "
                                                                     f"{SIZES})")]


@pytest.fixture(scope="module")
def loads(scenario_results):
    result = scenario_results[UNIVERSAL_LOAD]
    assert "error" not in result["universal_load"], result["universal_load"].get("error")
    return result["universal_load"], result["elastic_load"]


@pytest.mark.parametrize("kind", UNIVERSAL_KINDS)
def test_universal_checkpoint_loads_at_another_dp_size_as_the_checkpoint_does(loads, kind):
    universal, ordinary = loads
    run = universal[kind]["8bit"]
    saved_stage = int(kind.rsplit("stage", 1)[1])
    assert run["stage"] == LOADER_STAGES[saved_stage].get(UNIVERSAL_LOAD, saved_stage)
    assert run["state_identical"], "per-parameter state or master weights differ from what was saved"
    assert run["lr"] == ordinary[f"{kind}_from1"]["lr"] == [1e-3, 5e-4], "hyper-parameters come from the checkpoint"
    assert run["continued"] == ordinary[f"{kind}_from1"]["continued"]


def test_control_the_stock_kind_is_not_the_saved_state(loads):
    universal, _ = loads
    stock = universal[UNIVERSAL_KINDS[0]]["stock"]
    assert not stock["state_identical"]
    assert stock["continued"] != universal[UNIVERSAL_KINDS[0]]["8bit"]["continued"]
