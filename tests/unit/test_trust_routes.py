"""Every route into a checkpoint deepspeed_bnb wrote is read safely, whoever loads it, and the manifest defines what
the checkpoint is.

Routes (one rank each; a payload planted as an attacker would, the manifest rewritten to match):
- ZeRO-3 weights-only loads (`load_optimizer_states=False` at stage 3; also a ZeRO-2 checkpoint into a ZeRO-3
  engine), where DeepSpeed rebuilds the weights with zero_to_fp32: the payload never runs, and the weights come from
  the tag asked for, not from the one `latest` names. Controls: DeepSpeed's own zero_to_fp32 runs the payload, and
  called as DeepSpeed calls it (no tag) returns the other tag's weights.
- A bnb engine configured for universal checkpoints: read through the safe loader (its rewrite into a tag of ours
  stops at the planted payload), no weight changed, nothing left behind.
- Engines without a bnb optimizer (torch AdamW, none at all for evaluation): weights-only loads go through the safe
  loader, optimizer-state loads are refused clearly before anything changes. Control: with deepspeed_bnb's overrides
  switched off, the same load runs the payload.
The manifest: files copied into a tag, an entry removed, files and their entries removed, symbolic links (a file or
the tag itself), a `latest` leading out of the directory: each refused, naming the file. Controls: with the check
removed, the planted file is what gets loaded.
"""

import glob
import json
import os
import shutil

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.checkpoint.format import manifest as manifest_module
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError, UnsafeCheckpointError
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME
from deepspeed_bnb.cli import main
from deepspeed_bnb.installer import stock_deepspeed
from support.fault_injection import differences, engine_state
from support.tampering import copy_of, plant
from support.toy import MIN_8BIT_SIZE, build_engine, ds_config, make_model, param_groups, train_steps

RANK0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
MODEL = "mp_rank_00_model_states.pt"
MODEL3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def zero3_engine(seed=1):
    return build_engine(seed=seed, stage=3, min_8bit_size=MIN_8BIT_SIZE)


def gathered_weights(engine) -> dict:
    """The module's full weights (gathered at stage 3)."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if hasattr(params[0], "ds_id") else _nothing():
        return {name: p.detach().clone().float() for name, p in engine.module.named_parameters()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(scope="module")
def zero3_tags(one_rank, tmp_path_factory):
    """A ZeRO-3 checkpoint directory with tags `a` (2 steps) and `b` (3 steps, named by `latest`)."""
    root = str(tmp_path_factory.mktemp("z3"))
    engine = zero3_engine(seed=0)
    train_steps(engine, range(2))
    engine.save_checkpoint(root, tag="a")
    train_steps(engine, range(2, 3))
    engine.save_checkpoint(root, tag="b")
    return root


@pytest.fixture(scope="module")
def zero2_tag(one_rank, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("z2"))
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(2))
    engine.save_checkpoint(root, tag="t")
    return root, engine_state(engine)


def deepspeed_zero_to_fp32(folder, tag=None):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag)


def test_zero3_weights_only_load_reads_the_asked_tag(zero3_tags):
    expected = deepspeed_zero_to_fp32(zero3_tags, tag="a")  # DeepSpeed's own reader, given the tag: the oracle
    engine = zero3_engine()
    engine.load_checkpoint(zero3_tags, tag="a", load_optimizer_states=False)
    loaded = gathered_weights(engine)
    assert set(expected) == set(loaded)
    assert all(torch.equal(loaded[name], expected[name].float()) for name in expected)
    as_deepspeed_calls_it = deepspeed_zero_to_fp32(zero3_tags)  # control: no tag, so `latest` (b) wins
    assert any(not torch.equal(as_deepspeed_calls_it[n], expected[n]) for n in expected)


def test_zero3_weights_only_load_never_unpickles(zero3_tags, tmp_path):
    folder, marker = copy_of(zero3_tags, tmp_path), str(tmp_path / "marker")
    plant(os.path.join(folder, "a"), RANK0, marker)
    engine = zero3_engine()
    before = gathered_weights(engine)
    with pytest.raises(UnsafeCheckpointError, match=rf"{RANK0} needs the object posix.system"):
        engine.load_checkpoint(folder, tag="a", load_optimizer_states=False)
    assert not os.path.exists(marker)
    assert all(torch.equal(before[n], v) for n, v in gathered_weights(engine).items())
    deepspeed_zero_to_fp32(folder, tag="a")  # control: DeepSpeed's own reader runs the payload
    assert os.path.exists(marker)


def test_zero2_checkpoint_into_zero3_engine_weights_only(zero2_tag, tmp_path):
    source, saved = zero2_tag
    engine = zero3_engine()
    engine.load_checkpoint(source, load_optimizer_states=False)
    loaded = gathered_weights(engine)
    assert all(torch.equal(loaded[name], saved[f"module.{name}"].float()) for name in loaded)
    folder, marker = copy_of(source, tmp_path), str(tmp_path / "marker")
    plant(os.path.join(folder, "t"), MODEL, marker)
    with pytest.raises(UnsafeCheckpointError, match=rf"{MODEL} needs the object posix.system"):
        zero3_engine().load_checkpoint(folder, load_optimizer_states=False)
    assert not os.path.exists(marker)


def universal_engine(tmp_path):
    model = make_model(1)
    config = {**ds_config(1), "checkpoint": {"load_universal": True}}
    return deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model),
                                                                           min_8bit_size=MIN_8BIT_SIZE),
                                config=config)[0]


def test_bnb_engine_with_load_universal_reads_through_the_safe_loader(zero2_tag, tmp_path):
    source, _ = zero2_tag
    out, marker = str(tmp_path / "universal"), str(tmp_path / "marker")
    assert main(["export", source, out, "--universal", "--quiet"]) == 0
    plant(os.path.join(out, "t"), MODEL, marker)
    engine = universal_engine(tmp_path)
    before = engine_state(engine)
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        engine.load_checkpoint(out)
    assert not os.path.exists(marker) and not differences(engine_state(engine), before)
    assert sorted(os.listdir(out)) == ["latest_universal", "t"]  # the scratch tag is gone
    with stock_deepspeed(), pytest.raises(Exception):  # control: DeepSpeed's own route unpickles the files
        engine.load_checkpoint(out)
    assert os.path.exists(marker)


def torch_adamw_engine(stage=2, optimizer=True):
    model = make_model(1)
    config = ds_config(1, stage=stage)
    kwargs = {"optimizer": torch.optim.AdamW(param_groups(model))} if optimizer else {}
    return deepspeed.initialize(model=model, config=config, **kwargs)[0]


def test_stock_engine_reads_our_tag_through_the_safe_loader(zero2_tag, tmp_path):
    source, saved = zero2_tag
    engine = torch_adamw_engine()
    engine.load_checkpoint(source, load_optimizer_states=False)
    assert all(torch.equal(v, saved[f"module.{k}"]) for k, v in engine.module.state_dict().items())
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(CheckpointMismatchError,
                       match=r"holds bitsandbytes optimizer state .* torch.optim.adamw.AdamW cannot take"):
        engine.load_checkpoint(source)  # its optimizer cannot take 8-bit state: refused before anything changes
    assert all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    folder, marker = copy_of(source, tmp_path), str(tmp_path / "marker")
    plant(os.path.join(folder, "t"), MODEL, marker)
    for target in (torch_adamw_engine(), torch_adamw_engine(stage=0, optimizer=False)):  # training, evaluation
        with pytest.raises(UnsafeCheckpointError, match=rf"{MODEL} needs the object posix.system"):
            target.load_checkpoint(folder, load_optimizer_states=False)
        assert not os.path.exists(marker)
    with stock_deepspeed():  # control: DeepSpeed's own load runs the payload
        torch_adamw_engine().load_checkpoint(folder, load_optimizer_states=False)
    assert os.path.exists(marker)


# ---- the manifest defines the checkpoint -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_tag(one_rank, tmp_path_factory):
    """A tag of the same model saved in bf16 mode (its optimizer files named bf16_zero_pp_rank_*)."""
    root = str(tmp_path_factory.mktemp("bf16"))
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, zero=None, seed=3, lr=2e-2)
    train_steps(engine, range(4))
    engine.save_checkpoint(root, tag="t")
    bf16 = os.path.join(root, "t", "bf16_" + RANK0)
    os.rename(os.path.join(root, "t", RANK0), bf16)
    return bf16


def without_the_unlisted_check(monkeypatch):
    """The guard removed (the control): verify() as it was, reading the listed files only."""
    real = manifest_module.tag_files

    def listed_only(tag_dir):
        with open(os.path.join(tag_dir, MANIFEST_NAME)) as f:
            listed = json.load(f)["files"]
        return {name: size for name, size in real(tag_dir).items() if name in listed}
    monkeypatch.setattr(manifest_module, "tag_files", listed_only)


def test_files_copied_into_a_tag_are_refused(zero2_tag, bf16_tag, tmp_path, capsys):
    source, saved = zero2_tag
    folder = copy_of(source, tmp_path)
    planted = os.path.join(folder, "t", "bf16_" + RANK0)
    shutil.copy(bf16_tag, planted)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)
    with pytest.raises(CheckpointMismatchError, match=rf"holds bf16_{RANK0}, which its manifest .* does not list"):
        engine.load_checkpoint(folder)
    for command in (["inspect", folder, "--verify"], ["export", folder, str(tmp_path / "e"), "--quiet"]):
        assert main(command) == 2, command
        assert "does not list" in capsys.readouterr().err
    # control: the planted file is the one a bf16 engine would read (bf16 names are looked for first)
    from deepspeed_bnb.checkpoint.format.sources import rank_file_paths
    chosen = rank_file_paths(lambda rank, bf16: os.path.join(folder, "t", ("bf16_" if bf16 else "") + RANK0), 1, True)
    assert chosen == [planted]


def test_model_states_dropped_into_a_zero3_tag_are_refused(zero3_tags, tmp_path, monkeypatch):
    folder = copy_of(zero3_tags, tmp_path)
    tag_dir = os.path.join(folder, "a")
    states = torch.load(os.path.join(tag_dir, MODEL3), weights_only=False)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)  # ZeRO-2: reads mp_rank_00_model_states.pt first
    planted = dict(states, global_steps=777, module=dict(engine.module.state_dict()))
    torch.save(planted, os.path.join(tag_dir, MODEL))
    with pytest.raises(CheckpointMismatchError, match=rf"holds {MODEL}, which its manifest .* does not list"):
        engine.load_checkpoint(folder, tag="a", load_optimizer_states=False)
    without_the_unlisted_check(monkeypatch)  # control: without the check the planted file is what loads
    engine.load_checkpoint(folder, tag="a", load_optimizer_states=False)
    assert engine.global_steps == 777


def test_manifest_entries_cannot_be_dropped(zero2_tag, tmp_path):
    source, _ = zero2_tag
    for case in ("entry", "entry and file"):
        folder = copy_of(source, tmp_path, case.replace(" ", "_"))
        tag_dir = os.path.join(folder, "t")
        path = os.path.join(tag_dir, MANIFEST_NAME)
        with open(path) as f:
            manifest = json.load(f)
        del manifest["files"][RANK0]
        with open(path, "w") as f:
            json.dump(manifest, f)
        if case == "entry":
            needle = rf"holds {RANK0}, which its manifest .* does not list"
        else:
            os.remove(os.path.join(tag_dir, RANK0))
            needle = rf"does not list {RANK0}, which a checkpoint of its own description"
        with pytest.raises(CheckpointMismatchError, match=needle):
            build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
        assert main(["inspect", folder, "--verify"]) == 2


def test_links_inside_a_checkpoint_are_refused(zero2_tag, tmp_path):
    source, _ = zero2_tag
    outside = str(tmp_path / "outside.pt")
    folder = copy_of(source, tmp_path)
    tag_dir = os.path.join(folder, "t")
    shutil.move(os.path.join(tag_dir, MODEL), outside)
    os.symlink(outside, os.path.join(tag_dir, MODEL))
    assert torch.load(os.path.join(tag_dir, MODEL), weights_only=False)["dp_world_size"] == 1  # control: followed
    with pytest.raises(CheckpointMismatchError, match=rf"{MODEL} is a symbolic link \(to {outside}\)"):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
    assert main(["inspect", folder]) == 2
    linked = str(tmp_path / "linked")  # the tag directory itself a link to a checkpoint elsewhere
    os.makedirs(linked)
    os.symlink(os.path.join(source, "t"), os.path.join(linked, "t"))
    shutil.copy(os.path.join(source, "latest"), linked)
    with pytest.raises(CheckpointMismatchError, match=r"t is a symbolic link \(to .*\): a checkpoint's tag"):
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(linked)


def test_latest_leading_out_is_refused_for_stock_engines_too(zero2_tag, tmp_path):
    source, _ = zero2_tag
    folder = str(tmp_path / "inner")
    os.makedirs(folder)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write(os.path.relpath(os.path.join(source, "t"), folder))
    with pytest.raises(CheckpointMismatchError, match="latest names the tag .* not a plain name"):
        torch_adamw_engine().load_checkpoint(folder, load_optimizer_states=False)
    assert glob.glob(os.path.join(source, "t", MANIFEST_NAME))  # the target is a deepspeed_bnb tag (routed to us)


@pytest.mark.parametrize("stage", [2, 3])
def test_export_is_a_pickle_free_zero_to_fp32_for_stock_checkpoints(one_rank, tmp_path, stage):
    """`deepspeed-bnb export` reads a stock DeepSpeed checkpoint through the safe loader and gives what DeepSpeed's own
    zero_to_fp32 gives (the oracle, which unpickles every file in full)."""
    from safetensors.torch import load_file
    engine = torch_adamw_engine(stage=stage)
    train_steps(engine, range(2))
    folder = str(tmp_path / "stock")
    engine.save_checkpoint(folder, tag="s")
    assert not os.path.exists(os.path.join(folder, "s", MANIFEST_NAME))  # a stock save: no manifest
    expected = deepspeed_zero_to_fp32(folder, tag="s")
    with pytest.warns(RuntimeWarning, match="a stock DeepSpeed checkpoint"):
        assert main(["export", folder, str(tmp_path / "out"), "--quiet"]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[name], expected[name].float()) for name in expected)


def test_bnb_zero3_engine_loads_stock_zero3_weights(one_rank, tmp_path):
    """A stock ZeRO-3 checkpoint (torch AdamW: its fp32 flat groups are tensors with attributes, rebuilt through
    torch's _rebuild_from_type_v2) into a bnb ZeRO-3 engine, weights only: the weights zero_to_fp32 gives."""
    stock = torch_adamw_engine(stage=3)
    train_steps(stock, range(2))
    folder = str(tmp_path / "stock3")
    stock.save_checkpoint(folder, tag="s")
    expected = deepspeed_zero_to_fp32(folder, tag="s")
    engine = zero3_engine()
    with pytest.warns(RuntimeWarning, match="a stock DeepSpeed checkpoint"):
        engine.load_checkpoint(folder, tag="s", load_optimizer_states=False)
    loaded = gathered_weights(engine)
    assert all(torch.equal(loaded[name], expected[name].float()) for name in expected)
