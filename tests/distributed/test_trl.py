"""TRL's SFTTrainer drives deepspeed_bnb end to end on CPU: optim="adamw_bnb_8bit" under a ZeRO-2 and a ZeRO-3
DeepSpeed config, trained on 2 ranks, resumed on 1 from the 2-rank checkpoint with the losses of the run that never
stopped.

Two launches of examples/train_trl_sft.py (12 steps of a tiny GPT-2 on text that SFTTrainer tokenizes itself, global
batch 8, checkpoint-6), through tests/support/client_runs.py:
- torchrun 2 ranks: the ZeRO-2 run (configs/zero2_trl_sft.json), then the ZeRO-3 run (configs/zero3_trl_sft.json);
- torchrun 1 rank: each resumed from its checkpoint-6 for steps 7-12; control: the ZeRO-2 resume without the optimizer
  state (weights, step and lr schedule only).
SFTConfig's own defaults are kept, as a TRL user gets them: bf16 (the configs' `"bf16": {"enabled": "auto"}` becomes
DeepSpeed's bf16 engine, fp32 master weights in deepspeed_bnb's ZeRO optimizer) and gradient checkpointing. The runs
compared differ in the order of reductions of bf16 gradients, so the suite's bf16 bar of 5e-3 (measured up to 2.4e-4); a
lost optimizer state moves the losses by about 0.1-0.3, so the control must exceed 1e-2.
"""

import importlib.util
import os

import pytest
from conftest import ROOT, torchrun

from support.client_checks import CONTROL_MIN, TINY, max_diff, read

HAVE_TRL = all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets", "transformers"))
pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed (pip install trl, or the [clients] extra)")]

CONFIGS = {"zero2": "zero2_trl_sft.json", "zero3": "zero3_trl_sft.json"}
OPTIMIZERS = {"zero2": "BnbZeroOptimizer", "zero3": "BnbZeroStage3Optimizer"}
BF16_TOL = 5e-3


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trl"))

    def run(name, stage, extra):
        config = os.path.join(ROOT, "configs", CONFIGS[stage])
        return f"{name}:{TINY} --deepspeed {config} --output_dir {out}/{name} --log_json {out}/{name}.json {extra}"

    # ZeRO-3 runs last in a launch: DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process
    torchrun("support/client_runs.py", 2, "trl", out, run("zero2_2ranks", "zero2", "--save_steps 6"),
             run("zero3_2ranks", "zero3", "--save_steps 6"))
    torchrun("support/client_runs.py", 1, "trl", out,
             run("zero2_resume-weights-only", "zero2", f"--resume {out}/zero2_2ranks/checkpoint-6"),
             run("zero2_resume", "zero2", f"--resume {out}/zero2_2ranks/checkpoint-6"),
             run("zero3_resume", "zero3", f"--resume {out}/zero3_2ranks/checkpoint-6"))
    names = ("zero2_2ranks", "zero3_2ranks", "zero2_resume", "zero3_resume", "zero2_resume-weights-only")
    return {name: read(out, name) for name in names}


@pytest.mark.parametrize("stage", sorted(CONFIGS))
def test_sft_resumes_on_one_rank_with_the_same_losses(sft_runs, stage):
    run, reference = sft_runs[f"{stage}_resume"], sft_runs[f"{stage}_2ranks"]
    assert (run["world"], reference["world"]) == (1, 2)
    for log in (run, reference):
        assert log["optimizer"] == OPTIMIZERS[stage]
        assert (log["basic_optimizer"], log["optim_bits"]) == ("bitsandbytes.optim.adamw.AdamW", 8)
        assert log["bf16"] and log["gradient_checkpointing"]  # SFTConfig's defaults reached the engine
    assert sorted(map(int, run["losses"])) == list(range(7, 13))
    assert max_diff(run, reference) < BF16_TOL


def test_sft_resume_without_optimizer_state_differs(sft_runs):
    assert max_diff(sft_runs["zero2_resume-weights-only"], sft_runs["zero2_2ranks"]) > CONTROL_MIN


def test_sft_zero2_and_zero3_train_alike(sft_runs):
    """The same bnb state layout at stage 2 and 3: the two 2-rank runs agree step by step (an independent check that
    SFTTrainer's ZeRO-3 run is the same training, not only self-consistent)."""
    assert max_diff(sft_runs["zero3_2ranks"], sft_runs["zero2_2ranks"]) < BF16_TOL
