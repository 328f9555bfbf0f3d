"""Smoke test of benchmarks/compare_adam.py --quick and benchmarks/scaling.py --quick at DP=2.

The measured numbers are checked against quantities computed here from the model's shape and the DP size, not
against constants: fp32 Adam state is exactly 8 bytes per element of a rank's ZeRO partition (DeepSpeed pads each
param group to a multiple of 2*DP and splits it evenly), the checkpoint's master weights are 4 bytes per partition
element, and the 8-bit state is 0.2x-0.3x of the fp32 state. Negative controls show each check rejects a wrong input.
"""

import json
import os
import pathlib
import sys

import pytest
from conftest import ROOT, without_launch_vars
from support import background

pytestmark = pytest.mark.slow
BENCH = os.path.join(ROOT, "benchmarks")
QUICK = {"width": 64, "depth": 2, "context": 64, "vocab": 256}  # compare_adam.py / scaling.py --quick
DP = 2
CONFIGS = ("bnb8_fused", "bnb8_fallback", "torch_adamw", "ds_adamw")
FP32 = ("torch_adamw", "ds_adamw")
EIGHT_BIT = ("bnb8_fused", "bnb8_fallback")


def _script(fixture: str, script: str, *args: str) -> background.Job:
    """benchmarks/<script> as the job `fixture` reads, beside the earlier tests (tests/support/background.py), writing
    into the job's folder. A fresh machine first JIT-builds DeepSpeed's CPU fused_adam (~85 s); the timeout only ends
    a hang."""
    return background.Job(fixture, lambda folder: [sys.executable, os.path.join(BENCH, script), *args, "--out", folder],
                          without_launch_vars, timeout=1800)


COMPARE = _script("compare", "compare_adam.py", "--quick")
SCALING = _script("scaling", "scaling.py", "--quick", "--dp", str(DP))
COMPARE_BF16 = _script("bf16_compare", "compare_adam.py", "--quick", "--bf16")
BACKGROUND_JOBS = (COMPARE, SCALING, COMPARE_BF16)


def finished(job: background.Job) -> pathlib.Path:
    """The folder of the job's results; the test fails with its output when it did not exit 0."""
    done = background.result(job)
    if done.returncode != 0:
        why = "ran past its hang guard" if done.returncode is None else f"exited with {done.returncode}"
        pytest.fail(f"{job.name} {why}:\n{(done.stdout + done.stderr)[-6000:]}")
    return pathlib.Path(done.folder)


@pytest.fixture(scope="module")
def compare():
    out = finished(COMPARE)
    with open(out / "compare_adam.json") as f:
        return out, json.load(f)["results"]


@pytest.fixture(scope="module")
def scaling():
    out = finished(SCALING)
    with open(out / "scaling.json") as f:
        return out, json.load(f)["rows"]


# ---- independent expectations: from the architecture of deepspeed_bnb/demo/gpt.py, not from the code under test ------

def group_numels(width, depth, context, vocab):
    """Elements of AdamW's two groups: decay (matrices, embeddings) and no-decay (biases, LayerNorm)."""
    w = width
    decay = vocab * w + context * w + vocab * w + depth * (3 * w * w + w * w + 4 * w * w + 4 * w * w)
    other = depth * (2 * 2 * w + 3 * w + w + 4 * w + w) + 2 * w
    return [decay, other]


def tensor_numels(width, depth, context, vocab):
    """Every tensor's elements (the same model as group_numels, tensor by tensor: ZeRO-3 partitions each alone)."""
    w = width
    matrices = [vocab * w, context * w, vocab * w] + depth * [3 * w * w, w * w, 4 * w * w, 4 * w * w]
    vectors = [w, w] + depth * [w, w, 3 * w, w, w, w, 4 * w, w]
    assert [sum(matrices), sum(vectors)] == group_numels(width, depth, context, vocab)
    return matrices + vectors


def stock_partition_numel(groups, dp):
    """Elements a rank of stock ZeRO-1/2 owns: each group padded to a multiple of 2*dp, split evenly."""
    return sum(-(-g // (2 * dp)) * (2 * dp) // dp for g in groups)


# ---- checks (each has a negative control below) ----------------------------------------------------------------

def check_fp32_state(rank_result, groups, dp):
    moments = rank_result["state_bytes_by_key"]["exp_avg"] + rank_result["state_bytes_by_key"]["exp_avg_sq"]
    assert moments == 8 * stock_partition_numel(groups, dp)


def check_ratio(small, large, low=0.2, high=0.3):
    assert low <= small / large <= high, f"{small} / {large} = {small / large:.3f}"


def check_trains(losses):
    import math
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, "loss does not decrease"


def check_listed(markdown, labels):
    for label in labels:
        assert f"| {label} |" in markdown, f"{label!r} missing from the table"


# ---- compare_adam.py -------------------------------------------------------------------------------------------

def test_every_configuration_ran_and_is_reported(compare):
    out, results = compare
    assert set(results) == set(CONFIGS)
    sys.path.insert(0, BENCH)
    from compare_adam_configs import LABELS
    check_listed((out / "compare_adam.md").read_text(), [LABELS[c] for c in CONFIGS])
    for png in ("loss.png", "memory.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png


def test_what_ran(compare):
    _, r = compare
    for c in EIGHT_BIT:
        assert r[c]["zero_optimizer"].endswith("BnbZeroOptimizer")
        assert r[c]["base_optimizer"] == "bitsandbytes.optim.adamw.AdamW8bit"
    assert "fused" in r["bnb8_fused"]["update_path"] and "own" in r["bnb8_fallback"]["update_path"]
    for c in FP32:  # deepspeed_bnb leaves non-bnb optimizers to stock ZeRO
        assert r[c]["zero_optimizer"] == "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
    assert r["torch_adamw"]["base_optimizer"] == "torch.optim.adamw.AdamW"
    assert r["ds_adamw"]["base_optimizer"].startswith("deepspeed.ops.")


def test_model_size_matches_the_architecture(compare):
    _, r = compare
    assert all(x["n_params"] == sum(group_numels(**QUICK)) and x["world"] == DP for x in r.values())


@pytest.mark.parametrize("config", FP32)
def test_fp32_state_is_8_bytes_per_partition_element(compare, config):
    _, r = compare
    for rank_result in r[config]["per_rank"]:
        check_fp32_state(rank_result, group_numels(**QUICK), DP)


@pytest.mark.parametrize("config", EIGHT_BIT)
def test_8bit_state_is_a_quarter_of_fp32(compare, config):
    _, r = compare
    for mine, fp32 in zip(r[config]["per_rank"], r["torch_adamw"]["per_rank"]):
        check_ratio(mine["state_bytes"], fp32["state_bytes"])
        assert mine["state_bytes"] == mine["bnb_state_bytes"]  # the generic walk agrees with deepspeed_bnb's count


def test_checkpoint_optimizer_part(compare):
    _, r = compare
    partition = stock_partition_numel(group_numels(**QUICK), DP)
    assert r["torch_adamw"]["ckpt_optim_master"] == 4 * DP * partition  # fp32 master weights, every rank's file
    for c in EIGHT_BIT:
        state = r[c]["ckpt_optim"] - r[c]["ckpt_optim_master"]
        check_ratio(state, r["torch_adamw"]["ckpt_optim"] - r["torch_adamw"]["ckpt_optim_master"], 0.2, 0.35)
        assert r[c]["ckpt_optim"] < r["torch_adamw"]["ckpt_optim"]


@pytest.mark.parametrize("config", CONFIGS)
def test_trains(compare, config):
    _, r = compare
    check_trains(r[config]["losses"])
    assert r[config]["valid_loss"] < r[config]["losses"][0]
    assert r[config]["median_step_s"] > 0 and r[config]["per_rank"][0]["rss_peak_train"] > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_final_loss_within_2_percent_of_fp32(compare, config):
    _, r = compare
    final = {c: sum(r[c]["losses"][-5:]) / 5 for c in (config, "torch_adamw")}
    assert abs(final[config] / final["torch_adamw"] - 1) < 0.02


@pytest.mark.parametrize("config", CONFIGS)
def test_update_size_is_measured(compare, config):
    """Every step with a nonzero lr (WarmupLR starts at 0) reports its largest update in units of lr, and the table
    shows it; the fused kernel's largest stays within bnb's own update's (its defaults never spike where bnb does not:
    measured 1.59 against 1.90 here)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    from compare_adam_configs import LABELS
    out, r = compare
    sizes = r[config]["update_over_lr"]
    measured = [x for x in sizes if x is not None]
    assert len(sizes) == len(r[config]["losses"]) and len(measured) >= len(sizes) - 2, sizes
    assert all(0 < x < 100 for x in measured), sizes
    assert f"| {LABELS[config]} | {max(measured):.2f} |" in (out / "compare_adam.md").read_text()
    if config == "bnb8_fused":
        assert max(measured) <= 1.25 * max(x for x in r["bnb8_fallback"]["update_over_lr"] if x is not None)


def test_negative_controls(compare):
    """Each check above rejects what it must: none of them passes whatever the input."""
    out, r = compare
    groups = group_numels(**QUICK)
    with pytest.raises(AssertionError):  # partition math matters: the same state is wrong for another DP
        check_fp32_state(r["torch_adamw"]["per_rank"][0], groups, 1)
    with pytest.raises(AssertionError):  # and it is not an accident of the model: another width fails
        check_fp32_state(r["torch_adamw"]["per_rank"][0], group_numels(**{**QUICK, "width": 32}), DP)
    with pytest.raises(AssertionError):  # fp32 state is not in the 8-bit window
        check_ratio(r["ds_adamw"]["per_rank"][0]["state_bytes"], r["torch_adamw"]["per_rank"][0]["state_bytes"])
    with pytest.raises(AssertionError):  # a loss curve that rises is caught
        check_trains(r["torch_adamw"]["losses"][::-1])
    with pytest.raises(AssertionError):  # a table missing a configuration is caught
        markdown = (out / "compare_adam.md").read_text()
        check_listed(markdown.replace("| torch AdamW (fp32) |", "|"), ["torch AdamW (fp32)"])


# ---- scaling.py ------------------------------------------------------------------------------------------------

def test_scaling_measures_state_and_master_weights(scaling):
    _, rows = scaling
    groups = group_numels(**QUICK)
    partition = stock_partition_numel(groups, DP)
    by = {(x["stage"], x["optimizer"]): x for x in rows}
    assert set(by) == {(s, o) for s in (1, 2, 3) for o in ("torch_adamw", "bnb8")}
    zero3 = sum(-(-n // DP) for n in tensor_numels(**QUICK))  # stock ZeRO-3: each tensor padded to DP, split
    for stage in (1, 2, 3):
        fp32, bnb8 = by[(stage, "torch_adamw")], by[(stage, "bnb8")]
        n = fp32["n_params"]
        assert n == sum(groups)
        names = ("DeepSpeedZeroOptimizer_Stage3", "BnbZeroStage3Optimizer") if stage == 3 else \
            ("DeepSpeedZeroOptimizer", "BnbZeroOptimizer")
        assert (fp32["zero_optimizer"], bnb8["zero_optimizer"]) == names
        # torch AdamW: exp_avg + exp_avg_sq over the partition, plus a 4-byte step tensor per param group
        mine = zero3 if stage == 3 else partition
        assert round(fp32["measured"]["state"] * n) == 8 * mine + 4 * len(groups)
        assert round(fp32["measured"]["master"] * n) == 4 * mine
        check_ratio(bnb8["measured"]["state"], fp32["measured"]["state"])
        for x in (fp32, bnb8):
            assert x["measured"]["gradients"] * n >= 4 * partition  # at least this rank's gradient partition
            held = n * sum(x["measured"][role] for role in ("weights", "master", "state", "gradients"))
            assert x["unclaimed_max_bytes"] < 0.01 * held  # the census accounts for (nearly) every live tensor


# ---- compare_adam.py --quick --bf16: the master-weight modes ------------------------------------------------------

BF16_CONFIGS = ("torch_adamw", "ds_bf16_states", "bnb8_fused", "bnb8_master_bf16", "bnb8_master_compensated")
# bytes per element of each configuration's master weights, and of its moments where they are not 8-bit
MASTER_BYTES = {"torch_adamw": 4, "ds_bf16_states": 2, "bnb8_fused": 4, "bnb8_master_bf16": 2,
                "bnb8_master_compensated": 3}
MOMENT_BYTES = {"torch_adamw": 8, "ds_bf16_states": 4}


@pytest.fixture(scope="module")
def bf16_compare():
    with open(finished(COMPARE_BF16) / "compare_adam.json") as f:
        return json.load(f)["results"]


def _census(result, role) -> int:
    return sum(rank["census_peak"][role] for rank in result["per_rank"])


def test_bf16_master_and_state_bytes_follow_each_mode(bf16_compare):
    """Master weights: 4, 2 or 3 bytes (bf16 + int8 error) per element of the ranks' partitions (the fused fp32
    configuration's partition elements, which deepspeed_bnb's layout pads alike in every mode); the stock runs' per
    element of DeepSpeed's own partitions; moments 8 or 4 bytes per element (bf16 states), 8-bit state the same in
    every mode of ours. Control: the bf16 master weights are not the fp32 ones."""
    assert sorted(bf16_compare) == sorted(BF16_CONFIGS)
    ours = sum(rank["master_numel"] for rank in bf16_compare["bnb8_fused"]["per_rank"])
    stock = sum(rank["master_numel"] for rank in bf16_compare["torch_adamw"]["per_rank"])
    for config, result in bf16_compare.items():
        elements = stock if config in MOMENT_BYTES else ours
        assert _census(result, "master") == MASTER_BYTES[config] * elements, config
        if config in MOMENT_BYTES:
            assert MOMENT_BYTES[config] * elements <= _census(result, "state") <= MOMENT_BYTES[config] * elements + 64
    states = {_census(bf16_compare[c], "state") for c in ("bnb8_fused", "bnb8_master_bf16", "bnb8_master_compensated")}
    assert len(states) == 1 and states.pop() < _census(bf16_compare["ds_bf16_states"], "state") / 1.8
    assert _census(bf16_compare["bnb8_master_bf16"], "master") != _census(bf16_compare["bnb8_fused"], "master")


def test_bf16_modes_train_and_compensated_tracks_fp32(bf16_compare):
    reference = bf16_compare["torch_adamw"]["valid_loss"]
    for config, result in bf16_compare.items():
        assert result["losses"][-1] < result["losses"][0], config
    assert abs(bf16_compare["bnb8_master_compensated"]["valid_loss"] / reference - 1) < 0.02
    assert bf16_compare["bnb8_master_compensated"]["master_weights"] == "bf16+8"
    assert bf16_compare["ds_bf16_states"]["master_weights"] == "bfloat16"
