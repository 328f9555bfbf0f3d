"""Multi-rank behaviour on CPU ranks (gloo): DP=2 and DP=3 track DP=1, same-DP checkpoints resume bit-exactly.

The scenarios run in tests/distributed_scenarios.py, one torchrun launch per world size shared by all tests here.
Controls: stock DeepSpeed does not track DP=1 within the same bar, dropping the optimizer state on resume changes
the losses, and stock DeepSpeed's elastic checkpoint of a bnb optimizer fails to load.
"""

import json
import os

import pytest

from conftest import torchrun
from deepspeed_bnb.runtime.zero.compat import reduces_grad_accum

FP32_TOL = 1e-5  # issue bar: max |Δloss| over 20 steps
BF16_TOL = 5e-3  # bf16 rounds the gradients and the model copy: bf16 noise, not the optimizer
SCENARIOS = {1: "train", 2: "train,resume,stock_elastic,whole_mismatch", 3: "train,resume"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for world, scenarios in SCENARIOS.items():
        folder = tmp_path_factory.mktemp(f"world{world}")
        torchrun("distributed_scenarios.py", world, "--out", str(folder), "--scenarios", scenarios)
        with open(os.path.join(folder, f"results_world{world}.json")) as f:
            out[world] = json.load(f)
        for name, value in out[world].items():
            assert "error" not in value, f"world {world}, scenario {name}:\n{value['error']}"
    return out


def max_delta(a, b):
    assert len(a) == len(b) == 20
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["fp32_stage1", "fp32_stage2", "fp32_stage2_clip", "fp32_stage2_clip_accum",
                                    "fp32_stage2_offload", "fp32_stage2_round_robin", "fp32_stage2_bnb_update"])
def test_fp32_tracks_single_rank(results, world, config):
    run, single = results[world]["train"][config], results[1]["train"][config]
    assert run["optimizer"] == "BnbZeroOptimizer"
    assert max_delta(run["losses"], single["losses"]) < FP32_TOL
    assert single["losses"][-1] < single["losses"][0] - 0.5  # it trains


@pytest.mark.parametrize("world", [2, 3])
def test_stock_deepspeed_does_not_track_single_rank(results, world):
    """Negative control for the bar above: stock ZeRO quantizes per partition, so its state depends on DP."""
    run, single = results[world]["train"]["stock_fp32_stage2"], results[1]["train"]["stock_fp32_stage2"]
    assert run["optimizer"] == "DeepSpeedZeroOptimizer"
    assert max_delta(run["losses"], single["losses"]) > 10 * FP32_TOL


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_and_accumulation_match_their_baselines(results, world):
    train = results[world]["train"]
    assert train["fp32_stage2_offload"]["losses"] == train["fp32_stage2"]["losses"]  # same arithmetic, on CPU state
    assert max_delta(train["fp32_stage2_clip_accum"]["losses"], train["fp32_stage2_clip"]["losses"]) < FP32_TOL
    assert max_delta(train["fp32_stage2_clip"]["losses"], train["fp32_stage2"]["losses"]) > 10 * FP32_TOL  # clips


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", ["bf16_stage2_clip", "bf16_stage1_fp32_accum"])
def test_bf16_tracks_single_rank(results, world, config):
    run, single = results[world]["train"][config], results[1]["train"][config]
    if "refused" in run:  # only where DeepSpeed would not average ZeRO-1's fp32 accumulator (0.19.7)
        assert config == "bf16_stage1_fp32_accum" and not reduces_grad_accum(), run["refused"]
        return
    assert run["optimizer"] == "BnbZeroOptimizer"
    assert max_delta(run["losses"], single["losses"]) < BF16_TOL
    assert run["losses"][-1] < run["losses"][0] - 0.5
    if "bit16_is_rounded_master" in run:
        assert run["bit16_is_rounded_master"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["stage1_rigid", "stage1_elastic", "stage2_rigid", "stage2_elastic"])
def test_same_dp_resume_is_bit_exact(results, world, case):
    run = results[world]["resume"][case]
    assert run["resumed"] == run["reference"]
    assert run["bit_exact"], "master weights or optimizer state differ from the uninterrupted run"
    assert run["uint8_kept"], "state loaded into a fresh engine changed dtype"
    assert run["state_dropped"] != run["reference"], "control: without optimizer state the run must differ"
    assert run["files_ok"], "per-rank files must hold bnb's whole qmaps and untrimmed partition state"


def test_stock_elastic_checkpoint_fails(results):
    """Negative control: what the resume tests above guard against, measured on stock DeepSpeed."""
    assert not results[2]["stock_elastic"]["outcome"].startswith("loaded, state identical")


def test_whole_state_differing_between_ranks_refuses_to_save(results):
    run = results[2]["whole_mismatch"]
    assert "'my_map' (param group 0) differs between ranks" in run["outcome"]
    assert "bnb_keep_whole" in run["outcome"]
    assert not run["latest_written"], "a refused save must not publish anything"
