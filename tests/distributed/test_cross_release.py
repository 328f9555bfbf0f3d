"""One checkpoint format at every supported DeepSpeed release: a checkpoint written under this Python's DeepSpeed loads
under another release's, at another DP size and ZeRO stage, and comes back, with every byte of optimizer state and
master weights unchanged.

DEEPSPEED_BNB_OTHER_PYTHON names the other side: a Python whose DeepSpeed is another release, with this checkout
importable (tools/compat_matrix.py sets it to DeepSpeed 0.19.8's environment in every cell). Without it the tests
skip, saying so: the trip needs two environments.

The trip, for a checkpoint saved at ZeRO-2 and one saved at ZeRO-3:
  here,  2 ranks:  train 3 steps, save A; train 2 more (the uninterrupted run), save A_later
  there, 1 rank:   load A at another stage, save B at once, train the same 2 steps
  here,  2 ranks:  load B at a third stage, save C at once, train the same 2 steps
Checks: every parameter's bnb state (codes, absmax, fp32 moments, step) and fp32 master weights in A, B and C are the
same bytes (read by deepspeed_bnb's own reader, independent of the layout that wrote them); both continuations track
the uninterrupted run; each side built deepspeed_bnb's optimizer under its own release. Control: A_later, two steps
on, differs from A in that comparison.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TESTS, free_port, launch_env, run_or_fail

OTHER_ENV = "DEEPSPEED_BNB_OTHER_PYTHON"
OTHER = os.environ.get(OTHER_ENV, "")
pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(not OTHER, reason=f"needs {OTHER_ENV}: a Python with another DeepSpeed release "
                                                   "(the compatibility matrix sets it)")]
ROOT = os.path.dirname(TESTS)
# saving stage -> (the stage the other release loads at, the stage this one loads back at)
TRIPS = {2: (1, 3), 3: (2, 1)}
TOL = 1e-5  # fp32: another DP size sums gradients in another order


def launch(python: str, ranks: int, *args: str):
    env = launch_env(python)  # each release's own JIT cache
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, TESTS, env.get("PYTHONPATH", "")]))
    cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}",
           os.path.join(TESTS, "support", "cross_release_worker.py"), *args]
    run_or_fail(cmd, env, timeout=900, ranks=ranks)


def release(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('deepspeed'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def contents(folder: str, tag: str) -> dict:
    """parameter name -> its bnb state and fp32 master weights, as deepspeed_bnb's reader rebuilds them."""
    from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
    saved = SavedCheckpoint(os.path.join(folder, tag), verify_checksums=True)
    out = {}
    for g, group in enumerate(saved.groups):
        for name, state, master in zip(group["param_names"], saved.param_states(g), saved.master_weights(g)):
            out[name] = {**state, "master": master}
    return out


def differences(a: dict, b: dict) -> list:
    if a.keys() != b.keys():
        return [f"parameters {sorted(a)} != {sorted(b)}"]
    found = []
    for name in a:
        if a[name].keys() != b[name].keys():
            found.append(f"{name}: keys {sorted(a[name])} != {sorted(b[name])}")
            continue
        for key, x in a[name].items():
            y = b[name][key]
            same = (x.dtype == y.dtype and torch.equal(x, y)) if torch.is_tensor(x) else x == y
            if not same:
                found.append(f"{name}.{key}")
    return found


def result(folder: str) -> dict:
    with open(os.path.join(folder, "result.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=sorted(TRIPS), ids=lambda s: f"saved_at_stage{s}")
def trip(request, tmp_path_factory):
    stage = request.param
    there_stage, back_stage = TRIPS[stage]
    here, there, back = (str(tmp_path_factory.mktemp(f"{side}{stage}")) for side in ("here", "there", "back"))
    launch(sys.executable, 2, "save", "--stage", str(stage), "--out", here)
    launch(OTHER, 1, "reload", "--stage", str(there_stage), "--out", there, "--src", here, "--src-tag", "a")
    launch(sys.executable, 2, "reload", "--stage", str(back_stage), "--out", back, "--src", there, "--src-tag", "b")
    return {"A": contents(here, "a"), "A_later": contents(here, "a_later"), "B": contents(there, "b"),
            "C": contents(back, "b"), "here": result(here), "there": result(there), "back": result(back)}


def test_the_other_side_is_another_release():
    import deepspeed
    assert release(OTHER) != deepspeed.__version__, f"{OTHER_ENV} has this DeepSpeed ({deepspeed.__version__}) too"


def test_state_is_byte_identical_there_and_back(trip):
    assert differences(trip["A"], trip["B"]) == [], "loaded and saved again by the other release"
    assert differences(trip["A"], trip["C"]) == [], "and back here, at another stage"
    assert differences(trip["A"], trip["A_later"]), "control: two more steps change the state"


def test_both_continue_the_uninterrupted_run(trip):
    reference = trip["here"]["losses"]
    for side in ("there", "back"):
        losses = trip[side]["losses"]
        assert len(losses) == len(reference) and max(abs(a - b) for a, b in zip(losses, reference)) < TOL, side
    for side in ("here", "there", "back"):
        assert trip[side]["optimizer"] in ("BnbZeroOptimizer", "BnbZeroStage3Optimizer"), side
    assert trip["there"]["deepspeed"] != trip["here"]["deepspeed"] == trip["back"]["deepspeed"]
