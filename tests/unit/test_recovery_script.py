"""The zero_to_fp32.py beside a checkpoint reads it, or says what does (runtime/recovery_script.py).

DeepSpeed copies its zero_to_fp32.py next to every ZeRO checkpoint. Where that release's script reads deepspeed_bnb's
block-aligned ZeRO-1/2 layout (0.19.7 on), a ZeRO-2 save keeps it, and running it gives the weights the engine held;
on the earlier releases (and here with that answer forced, so that every release checks both) the save leaves a
script that exits with an error naming `deepspeed-bnb export`, whose weights are the engine's. A ZeRO-3 save keeps
DeepSpeed's script either way (its files hold stock slices). Control: DeepSpeed's own script of those releases
stops on these checkpoints (tests/distributed/test_offline_frozen.py holds it there).
"""

import os
import subprocess
import sys

import pytest
import torch
from deepspeed.utils import zero_to_fp32

import deepspeed_bnb  # noqa: F401
from conftest import without_launch_vars
from deepspeed_bnb.runtime import recovery_script
from support.toy import MIN_8BIT_SIZE, build_engine, gathered_weights, train_steps

DEEPSPEEDS = os.path.join(os.path.dirname(zero_to_fp32.__file__), "zero_to_fp32.py")


def saved(folder, stage: int):
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, stage=stage)
    train_steps(engine, range(2))
    engine.save_checkpoint(str(folder), tag="t")
    return gathered_weights(engine)


def run_script(folder):
    return subprocess.run([sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(folder / "fp32")],
                          capture_output=True, text=True, env=without_launch_vars(), timeout=600)


def same_bytes(a: str, b: str) -> bool:
    with open(a, "rb") as x, open(b, "rb") as y:
        return x.read() == y.read()


def test_the_script_beside_a_zero2_checkpoint_reads_it_or_refuses(one_rank, tmp_path):
    """This release's answer: DeepSpeed's script, which gives the engine's weights, or the guard, which refuses."""
    expected = saved(tmp_path, stage=2)
    done = run_script(tmp_path)
    if not recovery_script.reads_block_aligned():
        assert not same_bytes(str(tmp_path / "zero_to_fp32.py"), DEEPSPEEDS)
        assert done.returncode != 0 and "deepspeed-bnb export" in done.stderr, done.stderr
        return
    assert same_bytes(str(tmp_path / "zero_to_fp32.py"), DEEPSPEEDS)
    assert done.returncode == 0, done.stderr[-2000:]
    weights = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], value) for name, value in expected.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_a_release_whose_script_cannot_read_it_gets_the_guard(one_rank, tmp_path, monkeypatch, stage):
    from safetensors.torch import load_file

    from deepspeed_bnb.cli import main
    monkeypatch.setattr(recovery_script, "reads_block_aligned", lambda: False)  # as before DeepSpeed 0.19.7
    expected = saved(tmp_path / "ckpt", stage=stage)
    script = str(tmp_path / "ckpt" / "zero_to_fp32.py")
    if stage == 3:  # stock slices: DeepSpeed's own script reads them on every release
        assert same_bytes(script, DEEPSPEEDS)
        return
    done = run_script(tmp_path / "ckpt")
    assert done.returncode != 0 and f"deepspeed-bnb export {tmp_path / 'ckpt'} OUT" in done.stderr, done.stderr
    assert not (tmp_path / "ckpt" / "fp32").exists()
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0  # what it names
    weights = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(weights[name], value) for name, value in expected.items())
