"""Checkpoints load at any data-parallel size: every (N, M) in {1,2,3,4}², lossless, and training continues.

Two checkpoint kinds are saved at each N: fp32 with ZeRO-1 (elastic_checkpoint on) and bf16 with ZeRO-2 (off). Each
is loaded at each M, with the other ZeRO stage for even M, by an engine built with a 50x larger lr. Checks: every
parameter's codes, absmax, fp32 moments, step and fp32 master weights equal what was saved, byte for byte; the saved
lr is restored; 10 more steps track the run that never stopped. Control: loading without optimizer state diverges.
DP=1 runs in the test process (one rank): its saves come first and its loads last. Five launches between them: one
per N in 2..4 that saves and loads from N' <= N, then one per M in 2..3 that loads from the larger N (and, at M=3,
the DP=1 checkpoints rewritten offline for 3 ranks by `deepspeed-bnb reshape`).
"""

import functools
import glob
import json
import os
import shutil

import pytest
import torch

from conftest import torchrun
from deepspeed_bnb.checkpoint.reshape import reshape

SIZES = (1, 2, 3, 4)
FP32_TOL, BF16_TOL = 1e-5, 5e-3


def in_this_process(out, scenarios, sources):
    """The scenarios distributed_scenarios.py would run at DP=1, run here on the test's one-rank group (one thread,
    as a launched rank has)."""
    from distributed_scenarios import SCENARIOS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: SCENARIOS[name](1, 0, out, *([sources] if name == "elastic_load" else []))
                for name in scenarios.split(",")}
    finally:
        torch.set_num_threads(threads)


def launched(out, world, scenarios, sources):
    torchrun("distributed_scenarios.py", world, "--out", out, "--scenarios", scenarios,
             "--elastic-from", ",".join(sources))
    path = os.path.join(out, f"results_world{world}.json")
    with open(path) as f:
        result = json.load(f)
    os.remove(path)
    return result


@pytest.fixture(scope="module")
def runs(one_rank, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("elastic"))
    saves, loads = {}, {}
    plan = [(1, "elastic_save,elastic_load", ["1"])]
    plan += [(w, "elastic_save,elastic_load", [str(n) for n in SIZES[:w]]) for w in SIZES[1:]]
    plan += [(w, "elastic_load", [str(n) for n in SIZES[w:]] + (["r1"] if w == 3 else [])) for w in SIZES[:-1]]
    for world, scenarios, sources in plan:
        if "r1" in sources:  # the DP=1 checkpoints, rewritten offline for 3 ranks, must load like the originals
            for kind in ("fp32_stage1", "bf16_stage2"):
                folder = os.path.join(out, "elastic", kind)
                reshape(os.path.join(folder, "dp1"), os.path.join(folder, "reshaped1"), 3, progress=False)
                shutil.copy(os.path.join(folder, "dp1", "reference_state.pt"), os.path.join(folder, "reshaped1"))
        run = in_this_process if world == 1 else functools.partial(launched, world=world)
        result = run(out, scenarios=scenarios, sources=sources)
        for name, value in result.items():
            assert "error" not in value, f"world {world}, scenario {name}:\n{value['error']}"
        if "elastic_save" in result:
            saves[world] = result["elastic_save"]
        for key, value in result["elastic_load"].items():
            kind, saved = key.rsplit("_from", 1)
            loads[(kind, saved, world)] = value
    assert glob.glob(os.path.join(out, "elastic", "*", "dp4", "t", "*optim_states.pt"))
    return saves, loads


CASES = [(kind, n, m) for kind in ("fp32_stage1", "bf16_stage2") for n in SIZES for m in SIZES]


@pytest.mark.parametrize("kind,saved,loaded", CASES)
def test_load_at_any_dp(runs, kind, saved, loaded):
    saves, loads = runs
    run, reference = loads[(kind, str(saved), loaded)], saves[saved][kind]["continued"]
    saved_stage = 1 if kind.endswith("stage1") else 2
    assert run["stage"] == (saved_stage if loaded % 2 else 3 - saved_stage)
    assert run["state_identical"], "per-parameter state or master weights differ from what was saved"
    assert run["lr"] == [1e-3, 5e-4], "hyper-parameters must come from the checkpoint"
    tolerance = FP32_TOL if kind.startswith("fp32") else BF16_TOL
    assert max(abs(a - b) for a, b in zip(run["continued"], reference)) < tolerance
    assert max(abs(a - b) for a, b in zip(run["state_dropped"], reference)) > 100 * tolerance  # control
    if saved == loaded and kind.startswith("fp32") and run["stage"] == saved_stage:
        assert run["continued"] == reference


@pytest.mark.parametrize("kind", ["fp32_stage1", "bf16_stage2"])
def test_reshaped_checkpoint_loads_like_the_original(runs, kind):
    """`deepspeed-bnb reshape` of the DP=1 checkpoint to 3 ranks, loaded by 3 ranks."""
    saves, loads = runs
    run, original = loads[(kind, "r1", 3)], loads[(kind, "1", 3)]
    assert run["state_identical"] and run["lr"] == original["lr"]
    assert run["continued"] == original["continued"]
