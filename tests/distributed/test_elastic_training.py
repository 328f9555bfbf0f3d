"""Elastic training for real: examples/train.py under torchrun's elastic agent loses a node, trains on at the smaller
size, grows back, and ends where an uninterrupted run ends.

End to end (examples/elastic_failover.py, small settings, about a minute on 2 cores): two agents on 127.0.0.1 (one
rank each); the workers hold after step 7 and agent B and its worker are SIGKILLed; agent A's worker is restarted at
world size 1 and loads the latest complete checkpoint (step 6); it holds after step 9 (a checkpoint), a new agent B
joins and the job re-forms at world size 2 from step 9; it runs to step 30. Both changes of size wait for the step
the workers report (not for the clock), so the steps lost are known in advance, however fast the machine runs.
Against an uninterrupted run: every step's loss within 1e-5 (fp32), the held-out loss at each checkpoint too, and the
final weights far closer than those of the control, which resumes the same checkpoint with fresh optimizer state.
Unit tests: the batch plan, the step-indexed data order (each global batch dealt out exactly once at any world size),
the held-out split, checkpoint retention, the hold specs, and the failover plans refused (a hold met twice).
"""

import os
import sys

import pytest
import torch

from deepspeed_bnb.demo.elastic import batch_plan, parse_holds, rank_rows, step_windows
from conftest import ROOT, without_launch_vars
from support import background, examples

pytestmark = pytest.mark.multi_rank
SAVE_EVERY, STEPS = 3, 30
KILL_AT, REGROW_AT = 7, 9  # a step after a checkpoint (one step lost), and a checkpoint step (none lost)


# the example's own command line, a fresh process beside the earlier tests (tests/support/background.py); the timeout
# only ends a hang (each of its launches has its own, --timeout)
FAILOVER = background.Job("failover", lambda folder: [
    sys.executable, os.path.join(ROOT, "examples", "elastic_failover.py"), "--workdir", os.path.join(folder, "runs"),
    "--steps", str(STEPS), "--kill-at", str(KILL_AT), "--regrow-at", str(REGROW_AT), "--save-every", str(SAVE_EVERY),
    "--global-batch", "8", "--width", "32", "--depth", "1", "--reference-world", "1", "--no-noise-run", "--timeout",
    "300", "--json", os.path.join(folder, "summary.json")], without_launch_vars, timeout=1800)
BACKGROUND_JOBS = (FAILOVER,)


@pytest.fixture(scope="module")
def failover():
    return background.json_result(FAILOVER, "summary.json")


def test_the_job_shrinks_and_grows_back(failover):
    assert failover["world_sizes"] == [2, 1, 2], failover
    first, after_kill, after_grow = failover["start_steps"]
    assert first == 0 and 0 < after_kill < after_grow < STEPS, failover
    # the latest checkpoints at the kill and at the grow
    assert (after_kill, after_grow) == (KILL_AT // SAVE_EVERY * SAVE_EVERY, REGROW_AT), failover


def test_nothing_is_lost(failover):
    assert failover["max_loss_diff"] < 1e-5, failover  # every step, against the uninterrupted run
    assert failover["held_out_diff"] < 1e-5, failover
    assert failover["control_max_loss_diff"] > 1e-3, failover  # fresh optimizer state: visibly another run
    assert failover["final_weights_max_diff"] < failover["control_final_weights_max_diff"] / 10, failover


def test_lost_steps_are_those_since_the_last_checkpoint(failover):
    assert 0 <= failover["lost_on_kill"] < SAVE_EVERY, failover
    assert 0 <= failover["lost_on_grow"] < SAVE_EVERY, failover
    # by construction (the workers stood at a step boundary): exactly the steps since the last checkpoint
    assert (failover["lost_on_kill"], failover["lost_on_grow"]) == (KILL_AT % SAVE_EVERY, 0), failover


def test_hold_specs():
    assert parse_holds(["7@2", "9@1", "7@2"]) == {(7, 2), (9, 1)}
    for bad in ("7", "7@0", "x@2", "7@", "-1@2", "7@2@3"):
        with pytest.raises(ValueError, match="expected STEP@WORLD"):
            parse_holds([bad])


@pytest.mark.parametrize("kill_at, regrow_at, steps", [
    (7, 10, 30),  # the grow not at a checkpoint: a round that formed early would train and meet that hold again
    (2, 9, 30),  # no checkpoint before the kill: the smaller job would resume at step 0, a hold of its own
    (9, 9, 30), (7, 30, 30), (0, 9, 30)])
def test_failover_plans_the_holds_cannot_serve_are_refused(kill_at, regrow_at, steps):
    script = examples.load("elastic_failover")
    check_plan, parser = script.check_plan, script.parser
    args = parser().parse_args(["--kill-at", str(kill_at), "--regrow-at", str(regrow_at), "--steps", str(steps),
                                "--save-every", str(SAVE_EVERY)])
    with pytest.raises(ValueError, match="need"):
        check_plan(args)
    check_plan(parser().parse_args(["--kill-at", str(KILL_AT), "--regrow-at", str(REGROW_AT), "--steps", str(STEPS),
                                    "--save-every", str(SAVE_EVERY)]))  # the plan above passes


@pytest.mark.parametrize("global_batch, world, max_micro, expected", [
    (32, 2, 16, (16, 1)), (32, 1, 16, (16, 2)), (8, 8, 16, (1, 1)), (24, 2, 5, (4, 3)), (16, 4, 16, (4, 1))])
def test_batch_plan(global_batch, world, max_micro, expected):
    micro, accumulation = batch_plan(global_batch, world, max_micro)
    assert (micro, accumulation) == expected and micro * accumulation * world == global_batch


def test_batch_plan_refuses_an_uneven_split():
    with pytest.raises(ValueError, match="global batch of 32 sequences cannot be split evenly over 3 ranks"):
        batch_plan(32, 3, 16)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_each_global_batch_is_dealt_out_once_at_any_world_size(world):
    starts = step_windows(100_000, 64, 16, step=7, seed=0)
    assert torch.equal(starts, step_windows(100_000, 64, 16, step=7, seed=0))  # a function of the step alone
    assert not torch.equal(starts, step_windows(100_000, 64, 16, step=8, seed=0))
    micro, accumulation = batch_plan(16, world, 4)
    dealt = torch.cat([rank_rows(starts, micro, m, r, world) for m in range(accumulation) for r in range(world)])
    assert torch.equal(dealt.sort().values, starts.sort().values)


def test_retention_keeps_the_newest_and_what_latest_names(tmp_path):
    from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME
    from deepspeed_bnb.checkpoint.format.publish import STAGING_SUFFIX
    from deepspeed_bnb.checkpoint.format.retention import prune
    for step in range(1, 7):
        os.makedirs(tmp_path / f"global_step{step}")
        if step != 6:  # global_step6: a directory without a manifest (not complete): never touched
            (tmp_path / f"global_step{step}" / MANIFEST_NAME).write_text("{}")
    for step in (2, 9):
        os.makedirs(tmp_path / f".global_step{step}{STAGING_SUFFIX}")
    (tmp_path / "latest").write_text("global_step3")  # a resumed run's newest complete checkpoint
    deleted = prune(str(tmp_path), keep=2)
    assert sorted(deleted) == sorted(["global_step1", "global_step2", f".global_step2{STAGING_SUFFIX}"])
    assert sorted(os.listdir(tmp_path)) == sorted(["global_step3", "global_step4", "global_step5", "global_step6",
                                                   f".global_step9{STAGING_SUFFIX}", "latest"])
    with pytest.raises(ValueError, match="keep must be at least 1"):
        prune(str(tmp_path), keep=0)


def test_deepspeeds_elasticity_block_is_refused_by_deepspeed(one_rank):
    """DeepSpeed 0.19.8 removed its elasticity block and refuses a config holding one, naming the batch keys to set
    instead (what examples/train.py does per world size); deepspeed_bnb's routing does not change that."""
    import bitsandbytes as bnb
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfigError

    import deepspeed_bnb  # noqa: F401
    from support.toy import make_model, param_groups
    model = make_model(0)
    config = {"zero_optimization": {"stage": 2},
              "elasticity": {"enabled": True, "max_train_batch_size": 32, "micro_batch_sizes": [2, 4],
                             "min_gpus": 1, "max_gpus": 8, "version": 0.2}}
    with pytest.raises(DeepSpeedConfigError, match="Elastic training has been removed.*train_batch_size"):
        deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)), config=config)


def test_failover_refuses_a_used_workdir(tmp_path, capsys):
    """A second run in the same workdir would resume the first run's checkpoints: refused before any launch, or
    cleared (saying so) with --fresh."""
    script = examples.load("elastic_failover")
    parser, prepare_workdir = script.parser, script.prepare_workdir
    workdir = tmp_path / "failover"
    prepare_workdir(parser().parse_args(["--workdir", str(workdir)]))  # new: made
    (workdir / "elastic").mkdir()
    with pytest.raises(ValueError, match=r"already holds a run \(elastic\).*--fresh"):
        prepare_workdir(parser().parse_args(["--workdir", str(workdir)]))
    prepare_workdir(parser().parse_args(["--workdir", str(workdir), "--fresh"]))
    assert list(workdir.iterdir()) == [] and "--fresh: deleting the previous run" in capsys.readouterr().out
