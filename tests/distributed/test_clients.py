"""Accelerate and HF Trainer drive deepspeed_bnb end to end on CPU: save on N ranks, resume on M, match the run that
never stopped; under optimizer offload the bnb optimizer is kept where Accelerate would swap it for DeepSpeedCPUAdam.

Seven launches, 12 steps each of tiny models (examples/train_accelerate.py, examples/train_hf_trainer.py), saving after
step 6 (global batch 8: 4 per rank on 2 ranks, 8 on 1, the same sequences at each step):
- `accelerate launch` (configs/accelerate_zero2.yaml, 2 ranks): uninterrupted run, `accelerator.save_state` at 6;
- `accelerate launch --num_processes 1` with configs/zero2_accelerate_offload.json (offload, no
  `zero_force_ds_cpu_optimizer` key): `accelerator.load_state` then steps 7-12; control: the same without optimizer
  state;
- torchrun 2 ranks: Trainer (optim="adamw_bnb_8bit") uninterrupted, checkpoint-6;
- torchrun 1 rank: Trainer uninterrupted, checkpoint-6; resume from the 2-rank checkpoint-6; control without
  optimizer state;
- torchrun 2 ranks: Trainer resume from the 1-rank checkpoint-6, under offload;
- in the first two Trainer launches, the same with configs/zero3_hf_trainer.json: a 2-rank ZeRO-3 run, resumed from
  its checkpoint-6 on 1 rank; and two `accelerate launch` runs with configs/accelerate_zero3.yaml (save at 6 on 2
  ranks, resume on 1).
Tolerance: the runs compared differ only in the order of floating-point reductions (two half-batch means averaged by
DeepSpeed vs one full-batch mean), about 1e-7 relative per step: the suite's fp32 bar of 1e-5 (measured 5e-7 to
1.5e-6). Controls that lose the optimizer state differ by about 0.3, so they must exceed 1e-2.
"""

import importlib.util
import json
import os
import sys
import warnings

import pytest
from conftest import ROOT, free_port, launch_env, run_or_fail, torchrun

from support.client_checks import CONTROL_MIN, TINY, max_diff, read

pytestmark = pytest.mark.multi_rank
HAVE_ACCELERATE = importlib.util.find_spec("accelerate") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_accelerate = pytest.mark.skipif(not HAVE_ACCELERATE, reason="accelerate is not installed (pip install "
                                      "accelerate, or the [clients] extra)")
needs_transformers = pytest.mark.skipif(not (HAVE_ACCELERATE and HAVE_TRANSFORMERS), reason="transformers and "
                                        "accelerate are not installed (pip install transformers accelerate, or the "
                                        "[clients] extra)")

TOL = 1e-5


def accelerate_launch(ranks: int, *args) -> str:
    """`accelerate launch ARGS` of `ranks` ranks (a script ending with teardown.finish()) from the repository root
    (configs/ paths are relative to it); returns its output."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *args]
    done = run_or_fail(cmd, launch_env(), timeout=900, cwd=ROOT, ranks=ranks)
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate"))
    args = TINY.replace("--max_steps", "--steps")
    ckpt = os.path.join(out, "state")
    accelerate_launch(2, "--config_file", "configs/accelerate_zero2.yaml", "examples/train_accelerate.py",
                      *args.split(), "--save_at", "6", "--save_dir", ckpt,
                      "--log_json", os.path.join(out, "uninterrupted.json"))
    resume = f"{args} --resume {ckpt} --save_dir {out}/unused"
    output = accelerate_launch(
        1, "--config_file", "configs/accelerate_zero2.yaml", "--num_processes", "1",
        "--deepspeed_config_file", "configs/zero2_accelerate_offload.json", "tests/support/client_runs.py",
        "accelerate", out,
        f"resume:{resume} --log_json {out}/resume.json",
        f"resume-weights-only:{resume} --log_json {out}/control.json")
    return {name: read(out, name) for name in ("uninterrupted", "resume", "control", "imports")}, output


@needs_accelerate
def test_accelerate_resume_on_fewer_ranks_matches(accelerate_runs):
    logs, _ = accelerate_runs
    uninterrupted, resumed, control = logs["uninterrupted"], logs["resume"], logs["control"]
    assert (uninterrupted["world"], resumed["world"], resumed["start"]) == (2, 1, 6)
    assert len(resumed["losses"]) == 6
    assert max_diff(resumed, uninterrupted) < TOL
    assert max_diff(control, uninterrupted) > CONTROL_MIN  # the comparison does see a lost optimizer state


@needs_accelerate
def test_accelerate_keeps_bnb_under_offload(accelerate_runs):
    logs, output = accelerate_runs
    assert not logs["uninterrupted"]["offload"]
    for name in ("resume", "control"):
        assert logs[name]["offload"], name
        assert (logs[name]["optimizer"], logs[name]["basic_optimizer"]) == ("BnbZeroOptimizer", "AdamW8bit"), name
    assert "deepspeed_bnb: keeping AdamW8bit under offload_optimizer" in output
    assert logs["imports"]["prepare_deepspeed_from"] == "deepspeed_bnb.integrations.accelerate"


@pytest.fixture(scope="module")
def accelerate_zero3_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("accelerate_zero3"))
    args = TINY.replace("--max_steps", "--steps")
    ckpt = os.path.join(out, "state")
    # through client_runs.py, which ends its processes without gloo's C++ teardown (see there)
    accelerate_launch(2, "--config_file", "configs/accelerate_zero3.yaml", "tests/support/client_runs.py", "accelerate",
                      out,
                      f"uninterrupted:{args} --save_at 6 --save_dir {ckpt} --log_json {out}/uninterrupted.json")
    accelerate_launch(1, "--config_file", "configs/accelerate_zero3.yaml", "--num_processes", "1",
                      "tests/support/client_runs.py", "accelerate", out,
                      f"resume:{args} --resume {ckpt} --save_dir {out}/unused --log_json {out}/resume.json")
    return {name: read(out, name) for name in ("uninterrupted", "resume")}


@needs_accelerate
def test_accelerate_zero3_resume_on_one_rank_matches(accelerate_zero3_runs):
    """`accelerate launch` with a ZeRO-3 config (configs/accelerate_zero3.yaml): accelerator.save_state on 2 ranks,
    load_state on 1, the same losses."""
    uninterrupted, resumed = accelerate_zero3_runs["uninterrupted"], accelerate_zero3_runs["resume"]
    assert uninterrupted["optimizer"] == resumed["optimizer"] == "BnbZeroStage3Optimizer"
    assert (uninterrupted["world"], resumed["world"], resumed["start"]) == (2, 1, 6)
    assert len(resumed["losses"]) == 6 and max_diff(resumed, uninterrupted) < TOL


@needs_accelerate
def test_offload_decision():
    """Key absent: set false (kept). Explicitly true: left alone, with a warning naming the fix. Otherwise untouched."""
    import bitsandbytes as bnb
    import torch

    from deepspeed_bnb.integrations.accelerate import keep_bnb_under_offload

    bnb_opt = bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(4))])
    torch_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    offload = {"stage": 2, "offload_optimizer": {"device": "cpu"}}

    config = {"zero_optimization": dict(offload)}
    assert keep_bnb_under_offload(config, ["model", bnb_opt]) == "kept"
    assert config["zero_force_ds_cpu_optimizer"] is False

    config = {"zero_optimization": dict(offload), "zero_force_ds_cpu_optimizer": True}
    with pytest.warns(RuntimeWarning, match='"zero_force_ds_cpu_optimizer": false to keep'):
        assert keep_bnb_under_offload(config, [bnb_opt]) == "swapped"
    assert config["zero_force_ds_cpu_optimizer"] is True

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for config, prepared in (({"zero_optimization": dict(offload)}, [torch_opt]),
                                 ({"zero_optimization": {"stage": 2}}, [bnb_opt]),
                                 ({"zero_optimization": {"offload_optimizer": {"device": "none"}}}, [bnb_opt])):
            before = json.dumps(config)
            assert keep_bnb_under_offload(config, prepared) == "untouched"
            assert json.dumps(config) == before


@needs_accelerate
def test_accelerate_still_swaps_without_the_key():
    """Tripwire: the Accelerate behaviour the patch answers (swap unless the key is false) is still there."""
    import inspect

    from accelerate import Accelerator

    # importing deepspeed_bnb wraps an Accelerate imported before it too
    from deepspeed_bnb.integrations import accelerate as ours
    from deepspeed_bnb.installer import stock

    assert Accelerator._prepare_deepspeed is ours._prepare_deepspeed
    source = inspect.getsource(stock("Accelerator._prepare_deepspeed"))
    assert 'get("zero_force_ds_cpu_optimizer", True)' in source and "map_pytorch_optim_to_deepspeed(" in source


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("trainer"))
    with open(os.path.join(ROOT, "configs", "zero2_hf_trainer.json")) as f:
        offload = json.load(f)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}  # no zero_force_ds_cpu_optimizer key
    with open(os.path.join(out, "offload.json"), "w") as f:
        json.dump(offload, f)

    def run(name, extra):
        return f"{name}:{TINY} --output_dir {out}/{name} --log_json {out}/{name}.json {extra}"

    zero3 = f"--deepspeed {os.path.join(ROOT, 'configs', 'zero3_hf_trainer.json')}"
    # ZeRO-3 runs last in a launch: DeepSpeed's stage 3 replaces torch.nn.functional.linear for the whole process
    torchrun("support/client_runs.py", 2, "trainer", out, run("uninterrupted2", "--save_steps 6"),
             run("zero3_uninterrupted2", f"--save_steps 6 {zero3}"))
    torchrun("support/client_runs.py", 1, "trainer", out, run("uninterrupted1", "--save_steps 6"),
             run("resume2to1", f"--resume {out}/uninterrupted2/checkpoint-6"),
             run("resume2to1-weights-only", f"--resume {out}/uninterrupted2/checkpoint-6"),
             run("zero3_resume2to1", f"--resume {out}/zero3_uninterrupted2/checkpoint-6 {zero3}"))
    resume1to2 = run("resume1to2", f"--resume {out}/uninterrupted1/checkpoint-6 --deepspeed {out}/offload.json")
    offloaded = torchrun("support/client_runs.py", 2, "trainer", out, resume1to2)
    names = ("uninterrupted2", "uninterrupted1", "resume2to1", "resume2to1-weights-only", "resume1to2",
             "zero3_uninterrupted2", "zero3_resume2to1", "imports")
    return {name: read(out, name) for name in names}, offloaded.stdout + offloaded.stderr


@needs_transformers
def test_trainer_optimizer_is_bnb_inside_bnb_zero(trainer_runs):
    logs, offloaded_output = trainer_runs
    for name, log in logs.items():
        if name != "imports":
            assert log["optimizer"] == ("BnbZeroStage3Optimizer" if name.startswith("zero3") else
                                        "BnbZeroOptimizer"), name
            assert (log["basic_optimizer"], log["optim_bits"]) == ("bitsandbytes.optim.adamw.AdamW", 8), name
    assert logs["resume1to2"]["offload"] and not logs["resume2to1"]["offload"]
    assert "deepspeed_bnb: keeping AdamW under offload_optimizer" in offloaded_output


@needs_transformers
def test_trainer_same_losses_on_one_and_two_ranks(trainer_runs):
    one, two = trainer_runs[0]["uninterrupted1"], trainer_runs[0]["uninterrupted2"]
    assert (one["world"], two["world"], len(one["losses"])) == (1, 2, 12)
    assert max_diff(one, two) < TOL


@needs_transformers
@pytest.mark.parametrize("resumed,saved_by", [("resume2to1", "uninterrupted2"), ("resume1to2", "uninterrupted1")])
def test_trainer_resume_on_other_ranks_matches(trainer_runs, resumed, saved_by):
    run, reference = trainer_runs[0][resumed], trainer_runs[0][saved_by]
    assert run["world"] != reference["world"]
    assert sorted(map(int, run["losses"])) == list(range(7, 13))
    assert max_diff(run, reference) < TOL


@needs_transformers
def test_trainer_resume_without_optimizer_state_differs(trainer_runs):
    logs, _ = trainer_runs
    assert max_diff(logs["resume2to1-weights-only"], logs["uninterrupted2"]) > CONTROL_MIN


@needs_transformers
def test_accelerate_patch_arrives_lazily(trainer_runs):
    """`import deepspeed_bnb` does not import Accelerate; importing Accelerate afterwards installs the patch."""
    assert trainer_runs[0]["imports"] == {"accelerate_imported_by_deepspeed_bnb": False,
                                       "prepare_deepspeed_from": "deepspeed_bnb.integrations.accelerate"}


@needs_transformers
def test_trainer_zero3_resumes_on_one_rank(trainer_runs):
    """HF Trainer with a ZeRO-3 DeepSpeed config (configs/zero3_hf_trainer.json): checkpoint-6 of a 2-rank run
    resumes on 1 rank with the same losses; the 2-rank run itself matches the ZeRO-2 one (the same bnb state layout)."""
    logs = trainer_runs[0]
    run, reference = logs["zero3_resume2to1"], logs["zero3_uninterrupted2"]
    assert (run["world"], reference["world"]) == (1, 2)
    assert sorted(map(int, run["losses"])) == list(range(7, 13))
    assert max_diff(run, reference) < TOL
    assert max_diff(reference, logs["uninterrupted2"]) < TOL
