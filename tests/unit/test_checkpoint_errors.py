"""Loading a checkpoint that does not fit the engine fails with an error naming the file and the mismatch.

One CPU rank. Cases: another model, optimizer class, per-parameter precision, 8-bit vs 32-bit, param groups (each
refused before any weight changes; control: without the early check the module weights change), a checkpoint written by
stock DeepSpeed, a `latest` file naming a tag that is not there, a garbled manifest; plus hyper-parameters coming from
the checkpoint, as DeepSpeed users expect.
"""

import os

import bitsandbytes as bnb
import deepspeed
import pytest
import torch
from torch import nn

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from support.fault_injection import differences, engine_state
from support.toy import Awkward, build_engine, ds_config, make_model, param_groups, train_steps


def build(model=None, optimizer_cls=bnb.optim.AdamW8bit, lr=1e-3, stock=False, bnb_fused_kernel="auto", **kwargs):
    if model is None:
        return build_engine(optimizer_cls, lr=lr, stock=stock, zero={"bnb_fused_kernel": bnb_fused_kernel},
                            **{"min_8bit_size": 1000, **kwargs})
    optimizer = optimizer_cls(param_groups(model, lr=lr), **{"min_8bit_size": 1000, **kwargs})
    return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=2))[0]


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    engine = build()
    train_steps(engine, range(2))
    engine.save_checkpoint(str(path), tag="t")
    return str(path), engine, train_steps(engine, range(2, 4))


class Wider(Awkward):
    def __init__(self):
        super().__init__()
        self.fc2 = nn.Linear(301, 38)
        self.head = nn.Linear(38, 97)


class Reordered(nn.Module):
    """The same parameters as Awkward, registered in another order: module weights load, the flat order differs."""

    def __init__(self):
        super().__init__()
        reference = Awkward()
        for name in ("head", "fc2", "ln", "fc1", "emb"):
            self.add_module(name, getattr(reference, name))


def test_other_model_names_the_parameter(saved):
    path, _, _ = saved
    engine = build(model=Wider())
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointMismatchError, match=r"different model \(parameter #2 \(fc2.weight\): checkpoint "
                                                      r"11137, engine 11438 elements"):
        engine.load_checkpoint(path, tag="t")  # found before DeepSpeed loads the module (size mismatch, mid-load)
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    with pytest.raises(CheckpointMismatchError, match=r"different model \(parameter #0 \(head.weight\)"):
        build(model=Reordered()).load_checkpoint(path, tag="t")


def test_other_optimizer_class_is_named(saved):
    path, _, _ = saved
    expected = r"zero_pp_rank_0_mp_rank_00_optim_states.pt was written by .*AdamW8bit.*Lion8bit"
    with pytest.raises(CheckpointMismatchError, match=expected):
        build(optimizer_cls=bnb.optim.Lion8bit).load_checkpoint(path, tag="t")


def test_other_precision_is_named(saved):
    path, _, _ = saved
    with pytest.raises(CheckpointMismatchError, match=r"precision differs.*min_8bit_size"):
        build(min_8bit_size=5000).load_checkpoint(path, tag="t")


def test_stock_checkpoint_is_refused_with_a_way_out(one_rank, tmp_path):
    stock = build(stock=True)
    train_steps(stock, range(1))
    stock.save_checkpoint(str(tmp_path), tag="s")
    with pytest.raises(CheckpointMismatchError, match="stock DeepSpeed.*load_optimizer_states=False"):
        build().load_checkpoint(str(tmp_path), tag="s")
    build().load_checkpoint(str(tmp_path), tag="s", load_optimizer_states=False)  # the way out works


REFUSALS = {  # what the engine that loads differs in -> how it is built, and the error it must give
    "optimizer class": (lambda: build(optimizer_cls=bnb.optim.Lion8bit), "was written by .*AdamW8bit"),
    "min_8bit_size": (lambda: build(min_8bit_size=5000), "precision differs"),
    "8-bit vs 32-bit": (lambda: build(optimizer_cls=bnb.optim.AdamW), "was written by .*AdamW8bit.*AdamW"),
    "param groups": (lambda: one_group_engine(), "has 2 param groups; this engine has 1"),
}


def one_group_engine():
    model = make_model(0)
    optimizer = bnb.optim.AdamW8bit([{"params": list(model.parameters()), "lr": 1e-3}], min_8bit_size=1000)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=2))[0]


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_load_changes_nothing(saved, case):
    """DeepSpeed loads the module weights before the optimizer state: a refusal found only then would leave new
    weights with old master weights (the next step pulls them back). Everything is checked first."""
    path, _, _ = saved
    make, expected = REFUSALS[case]
    engine = make()
    train_steps(engine, range(1))  # weights and state that differ from the checkpoint's
    before = engine_state(engine)
    with pytest.raises(CheckpointMismatchError, match=expected):
        engine.load_checkpoint(path, tag="t")
    assert not differences(engine_state(engine), before)


def test_hyperparameters_come_from_the_checkpoint(saved):
    """A loader built with another lr resumes with the saved lr and moments, bit-exactly."""
    path, _, reference = saved
    engine = build(lr=5e-2)
    engine.load_checkpoint(path, tag="t")
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-3, 5e-4]
    assert train_steps(engine, range(2, 4)) == reference


def test_checkpoint_loads_with_either_update_path(saved, tmp_path):
    """Saved by the fused kernel, loaded by bnb's own update and back: the flat state is the same."""
    path, engine, _ = saved
    assert engine.optimizer.bnb_steps[0].fused is not None
    unfused = build(bnb_fused_kernel=False)
    unfused.load_checkpoint(path, tag="t")
    for a, b in zip(unfused.optimizer.single_partition_of_fp32_groups,
                    engine.optimizer.single_partition_of_fp32_groups):
        state_a, state_b = unfused.optimizer.optimizer.state[a], engine.optimizer.optimizer.state[b]
        assert state_a.keys() == state_b.keys()
    train_steps(unfused, range(2, 3))
    unfused.save_checkpoint(str(tmp_path), tag="u")
    fused = build()
    fused.load_checkpoint(str(tmp_path), tag="u")
    assert fused.global_steps == 3 and fused.optimizer.bnb_steps[0].fused is not None


def test_deepspeeds_list_entry_point_is_refused(saved):
    """DeepSpeed's load_state_dict(list of every rank's element-wise state) is not how BnbZeroOptimizer loads: it
    says which entry point to use, and changes nothing. Control: engine.load_checkpoint loads the same checkpoint."""
    path, engine, _ = saved
    fresh = build(lr=5e-2)
    before = [p.clone() for p in fresh.optimizer.single_partition_of_fp32_groups]
    state = torch.load(f"{path}/t/zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    with pytest.raises(NotImplementedError, match=r"engine.load_checkpoint"):
        fresh.optimizer.load_state_dict([state["optimizer_state_dict"]])
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.optimizer.single_partition_of_fp32_groups))
    fresh.load_checkpoint(path, tag="t")
    assert [g["lr"] for g in fresh.optimizer.param_groups] == [1e-3, 5e-4]


def test_latest_naming_a_missing_tag_names_the_file_and_the_tags(saved, tmp_path):
    """Stock DeepSpeed fails on a bare AssertionError when `latest` names a tag that is not there (control below)."""
    import shutil
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], folder)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("global_step999")
    with pytest.raises(CheckpointMismatchError, match=r"latest names tag 'global_step999', but .* does not exist\. "
                                                      r"Tags there: \['t'\]"):
        build().load_checkpoint(folder)
    with pytest.raises(CheckpointMismatchError, match="tag 'nope' was asked for"):
        build().load_checkpoint(folder, tag="nope")
    with pytest.raises(AssertionError):  # control: what stock DeepSpeed does with the same directory
        build(stock=True).load_checkpoint(folder)


def test_garbled_manifest_names_the_file(saved, tmp_path):
    import shutil
    folder = str(tmp_path / "ckpt")
    shutil.copytree(saved[0], folder)
    manifest = os.path.join(folder, "t", "deepspeed_bnb_manifest.json")
    with open(manifest, "w") as f:
        f.write('{"files": ')
    with pytest.raises(CheckpointMismatchError, match=rf"{manifest} is not valid JSON .* load another tag"):
        build().load_checkpoint(folder, tag="t")


def test_refusal_without_the_early_check_changes_weights_control(saved, monkeypatch):
    """Without the check before DeepSpeed's load, the same refusal comes after the module weights were replaced."""
    import deepspeed_bnb.runtime.checkpointing as bnb_engine
    monkeypatch.setattr(bnb_engine, "_check_fits", lambda *args: None)
    path, _, _ = saved
    engine = build(min_8bit_size=5000)
    train_steps(engine, range(1))
    before = engine_state(engine)
    with pytest.raises(CheckpointMismatchError, match="precision differs"):
        engine.load_checkpoint(path, tag="t")
    assert [k for k in differences(engine_state(engine), before) if k.startswith("module.")]
