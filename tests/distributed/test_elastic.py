"""Checkpoints load at any data-parallel size: every (N, M) in {1,2,3,4}², lossless, and training continues.

Six checkpoint kinds are saved at each N: fp32 with ZeRO-1 (elastic_checkpoint on), bf16 with ZeRO-2 (off), fp32
with ZeRO-3, fp32 with ZeRO-3 and frozen parameters (whose weights ZeRO-3 saves as per-rank slices; saved once more
with exclude_frozen_parameters), fp32 ZeRO-2 with a DeepSpeed MoE layer whose 4 experts are spread over
distributed_scenarios.MOE_EP[N] expert-parallel ranks (so N -> M changes the expert-parallel size, the experts'
data-parallel size, or both), and bf16 ZeRO-3 with compensated master weights (bf16 plus an int8 error term, whose
joined values are compared). Each is loaded at each M, under another ZeRO stage for even M (1 -> 2 and 3,
2 -> 1, 3 -> 2 and 1: distributed_scenarios.LOADER_STAGES), by an engine built with a 50x larger lr and another seed.
Checks: every parameter's codes, absmax, fp32 moments, step and fp32 master weights (frozen: its weights) equal what
was saved, byte for byte; the saved lr is restored; 10 more
steps track the run that never stopped. Control: loading without optimizer state diverges (once per kind and loading
DP size). The ZeRO-3 checkpoints are
also read by DeepSpeed's own zero_to_fp32 and written as a gathered 16-bit model: both give the saved weights.
The scenarios run in launches shared with test_distributed.py (tests/support/scenario_runs.py): DP=1 in the test
process, then one launch per N in 2..4 that saves and loads from N' <= N, then one per M in 2..3 that loads from the
larger N (and, at M=3, the DP=1 checkpoints rewritten offline for 3 ranks by `deepspeed-bnb reshape`).
"""

import pytest

from support.distributed_scenarios import ELASTIC_KINDS, RESHAPED_KINDS, loader_stage
from support.scenario_runs import SIZES
from support.toy import make_model

pytestmark = pytest.mark.multi_rank
FP32_TOL, BF16_TOL = 1e-5, 5e-3


@pytest.fixture(scope="module")
def runs(scenario_results):
    saves = {world: result["elastic_save"] for world, result in scenario_results.items() if "elastic_save" in result}
    loads = {}
    for world, result in scenario_results.items():
        for key, value in result["elastic_load"].items():
            kind, saved = key.rsplit("_from", 1)
            loads[(kind, saved, world)] = value
    reshaped = len(RESHAPED_KINDS) if len(SIZES) > 3 else 0  # loaded at 3 ranks, in the launch after DP 4 saved
    assert sorted(saves) == list(SIZES) and len(loads) == len(ELASTIC_KINDS) * len(SIZES) ** 2 + reshaped
    return saves, loads, controls(loads)


def controls(loads) -> dict:
    """(kind, loading DP size) -> the losses of a load without optimizer state (run once per kind and launch, from
    that launch's first source: distributed_scenarios.scenario_elastic_load), and one for every pair."""
    found = {}
    for (kind, _, world), run in loads.items():
        if run["state_dropped"] is not None:
            found.setdefault((kind, world), run["state_dropped"])
    assert sorted(found) == sorted((kind, m) for kind in ELASTIC_KINDS for m in SIZES), sorted(found)
    return found


CASES = [(kind, n, m) for kind in ELASTIC_KINDS for n in SIZES for m in SIZES]


@pytest.mark.parametrize("kind,saved,loaded", CASES)
def test_load_at_any_dp(runs, kind, saved, loaded):
    saves, loads, dropped = runs
    run, reference = loads[(kind, str(saved), loaded)], saves[saved][kind]["continued"]
    saved_stage = ELASTIC_KINDS[kind]["stage"]
    assert run["stage"] == loader_stage(kind, loaded)
    assert run["state_identical"], "per-parameter state or master weights differ from what was saved"
    assert run["weights_follow_master"], "the module's weights are not the loaded master weights"
    assert run["parameters"] == len(list(make_model(0, ep_size=1 if ELASTIC_KINDS[kind].get("moe") else None)
                                         .parameters())), "every parameter (each expert) under its own name"
    groups = 2 if ELASTIC_KINDS[kind].get("moe") else 1  # MoE: the expert parameters' groups besides the others
    assert run["lr"] == [1e-3, 5e-4] * groups, "hyper-parameters must come from the checkpoint"
    tolerance = FP32_TOL if kind.startswith("fp32") else BF16_TOL
    assert max(abs(a - b) for a, b in zip(run["continued"], reference)) < tolerance, \
        {"continued": run["continued"], "reference": reference, "state_dropped": dropped[(kind, loaded)]}
    # control: fresh moments, from this kind's first source loaded at this size (the uninterrupted runs of every
    # saved size agree to within the bar, so this one shows the bar catches a lost state for each)
    assert max(abs(a - b) for a, b in zip(dropped[(kind, loaded)], reference)) > 100 * tolerance
    if saved == loaded and kind.startswith("fp32") and run["stage"] == saved_stage:
        assert run["continued"] == reference


@pytest.mark.parametrize("saved", SIZES)
def test_deepspeed_reads_the_zero3_weights(runs, saved):
    """DeepSpeed's zero_to_fp32 (stock ZeRO-3 slices in fp32_flat_groups) and stage3_gather_16bit_weights_on_model_save
    give exactly the saved fp32 master weights of every parameter."""
    for kind in ("fp32_stage3", "fp32_stage3_frozen", "bf16c_stage3"):  # compensated: the values they stand for
        if kind not in ELASTIC_KINDS:  # DeepSpeed before 0.18.3: no bf16 master weights
            continue
        assert runs[0][saved][kind]["exports"] == {"zero_to_fp32": True, "gathered_16bit": True}, kind


@pytest.mark.parametrize("saved", SIZES)
def test_expert_checkpoints_read_offline(runs, saved):
    """An MoE checkpoint offline: `export` gives every parameter's saved fp32 master weights, each expert under its
    global name (DeepSpeed's numbering of expert files), `inspect` lists every expert, `reshape` (which would have to
    choose the new run's expert placement) refuses by name."""
    offline = runs[0][saved]["fp32_moe_stage2"]["offline"]
    assert offline["exported"] and offline["listed"], offline
    assert "holds expert groups (DeepSpeed MoE), which `deepspeed-bnb reshape` does not handle" in offline["reshape"]


FROZEN_CASES = [(n, m) for n in SIZES for m in SIZES]


@pytest.mark.parametrize("saved,loaded", FROZEN_CASES)
def test_frozen_parameters_excluded_from_the_save(runs, saved, loaded):
    """save_checkpoint(exclude_frozen_parameters=True) at ZeRO-3, loaded at any DP size (and stage): the trained
    state as saved, the frozen parameters keep the loading engine's weights (which differ from the saved ones)."""
    run = runs[1][("fp32_stage3_frozen", str(saved), loaded)]["excluded_frozen"]
    assert run == {"trained_identical": True, "frozen_kept": True, "frozen_differ_from_saved": True}


@pytest.mark.skipif(len(SIZES) < 4, reason="the reshaped checkpoint is loaded by 3 ranks in the launch after DP 4 "
                    "saved; DEEPSPEED_BNB_SCENARIO_SIZES leaves those out")
@pytest.mark.parametrize("kind", RESHAPED_KINDS)
def test_reshaped_checkpoint_loads_like_the_original(runs, kind):
    """`deepspeed-bnb reshape` of the DP=1 checkpoint to 3 ranks (stage 1 -> files of stage 3, stage 3 -> stage 2),
    loaded by 3 ranks."""
    saves, loads, _ = runs
    run, original = loads[(kind, "r1", 3)], loads[(kind, "1", 3)]
    assert run["state_identical"] and run["lr"] == original["lr"]
    assert run["continued"] == original["continued"]
