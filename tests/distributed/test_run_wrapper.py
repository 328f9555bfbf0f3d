"""`deepspeed-bnb run -- COMMAND`: deepspeed_bnb active in every Python process of a command one does not own
(deepspeed_bnb/launch/), checked in fresh processes and launches by tests/support/run_wrapper_checks.py, one
background job.

The training script (tests/support/run_wrapper_rank.py) never imports deepspeed_bnb. Oracle: the same script under
the same launcher without the wrapper (stock DeepSpeed builds its own ZeRO optimizer for the bnb optimizer, and
deepspeed_bnb is never loaded), and a plain Python process (nothing changes for a process that did not ask).
"""

import os
import sys

import pytest

from conftest import without_launch_vars
from support import background

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRAPPER_CHECKS = background.Job("wrapper_checks", lambda folder: [
    sys.executable, os.path.join(ROOT, "tests", "support", "run_wrapper_checks.py"), folder],
    without_launch_vars, timeout=1800)
BACKGROUND_JOBS = (WRAPPER_CHECKS,)
LAUNCHERS = ("torchrun", "deepspeed_launcher", "accelerate")

pytestmark = pytest.mark.multi_rank


@pytest.fixture(scope="module")
def wrapper_checks():
    return background.json_result(WRAPPER_CHECKS, "checks.json")


def test_a_wrapped_process_activates_at_deepspeeds_import_and_a_plain_one_is_untouched(wrapper_checks):
    # PROBE: loaded before `import deepspeed`, loaded after it, overrides installed
    assert wrapper_checks["wrapped"]["probes"] == [["False", "True", "True"]], wrapper_checks["wrapped"]
    assert wrapper_checks["plain"]["probes"] == [["False", "False", "None"]], wrapper_checks["plain"]  # control
    # a wrapped process that never imports DeepSpeed pays nothing: neither deepspeed_bnb nor torch is loaded
    assert wrapper_checks["wrapped_no_deepspeed"]["probes"] == [["False", "False"]]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_rank_a_launcher_starts_gets_the_block_aware_optimizer(wrapper_checks, launcher):
    """torchrun, the deepspeed launcher and accelerate launch (configs/accelerate_zero2.yaml), each 2 ranks, wrapped:
    every rank's engine for AdamW8bit is deepspeed_bnb's, stepping 8-bit state; its engine for torch AdamW stays
    DeepSpeed's; the log says each once (what stepping 8-bit state looks like in a framework's log)."""
    run = wrapper_checks[launcher]
    assert run["ok"] and len(run["ranks"]) == 2, run["tail"]
    for rank in run["ranks"]:
        assert rank["bnb_engine"] == "BnbZeroOptimizer" and rank["state1_dtype"] == "torch.uint8", rank
        assert rank["deepspeed_bnb_with_deepspeed"], rank  # active from DeepSpeed's import on
        assert rank["torch_engine"] == "DeepSpeedZeroOptimizer", rank  # not a bnb optimizer: unchanged
    assert run["sentence"] == 1 and run["routed"] == 1, run["tail"]  # each said once, by rank 0


def test_without_the_wrapper_the_same_launch_is_stock(wrapper_checks):
    run = wrapper_checks["torchrun_plain"]
    assert run["ok"] and len(run["ranks"]) == 2, run["tail"]
    for rank in run["ranks"]:
        assert rank["bnb_engine"] == "DeepSpeedZeroOptimizer" and not rank["deepspeed_bnb_loaded"], rank
    assert run["sentence"] == 0 and run["routed"] == 0


def test_the_environments_own_sitecustomize_still_runs(wrapper_checks):
    """It runs in the wrapper's own process ("-": not yet wrapped) and, chained by ours, in the command's ("1")."""
    probes = wrapper_checks["chained"]["probes"]
    assert probes[-2:] == [["other-sitecustomize-ran", "1"], ["False", "True", "True"]], wrapper_checks["chained"]
    assert wrapper_checks["chained_plain"]["probes"] == [["other-sitecustomize-ran", "-"]]  # control: the same file


def test_bad_input_stops_before_training_with_the_reason(wrapper_checks):
    not_found = wrapper_checks["not_found"]
    assert not_found["rc"] == 127 and "'no-such-command-here': command not found" in not_found["tail"], not_found
    none = wrapper_checks["no_command"]
    assert none["rc"] == 2 and "it needs the command to run after it" in none["tail"], none
    up_front = wrapper_checks["untested_up_front"]  # the wrapper's own check: the command never starts
    assert up_front["rc"] == 2 and up_front["probes"] == [] and "deepspeed 0.15.0 is installed" in up_front["tail"]
    rank = wrapper_checks["cannot_activate"]  # a process whose DeepSpeed the wrapper did not check
    assert rank["rc"] != 0 and rank["probes"] == [], rank["tail"]
    assert "deepspeed_bnb could not be activated in this process" in rank["tail"] and "0.15.0" in rank["tail"]
