"""Padding tensors (DeepSpeed releases before 0.19.7) give what DeepSpeed's per-parameter padding gives (0.19.7 on).

Both ways of placing the block-aligned ZeRO-1/2 layout are built on the installed DeepSpeed (which has both;
DEEPSPEED_BNB_ZERO_PADDING picks one per engine) from the same model, and compared: the flat buffers, every weight and
every byte of optimizer state after training (fp32 and bf16, stage 1 and 2, with round-robin gradients), the
checkpoint files (per-parameter state, master weights, parameter shapes, paddings), and loads across the two. The
padding tensors stay exactly zero, carry no hp mapping, and are hidden from the names DeepSpeed saves.
Control: with the padding tensors not placed, the layout check refuses the engine. (The compatibility matrix runs the
whole claim set on releases that only have padding tensors; tests/distributed/test_distributed.py trains with them on 2
and 3 ranks.)
"""

import os

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.runtime.zero import padding_tensors
from deepspeed_bnb.runtime.zero.compat import PADDING_ENV, PADDING_TENSORS, PARAM_PADDING, has_parameter_padding
from support.toy import ds_config, make_model, param_groups, train_steps

pytestmark = pytest.mark.skipif(not has_parameter_padding(), reason="compares with DeepSpeed's per-parameter "
                                "padding, which this DeepSpeed release lacks (the matrix covers it there)")
CASES = {"stage1": dict(stage=1), "stage2": dict(stage=2), "bf16_stage2": dict(stage=2, bf16=True),
         "stage2_round_robin": dict(stage=2, round_robin_gradients=True)}


def build(mode: str, monkeypatch, **cfg):
    monkeypatch.setenv(PADDING_ENV, mode)
    model = make_model(0)
    optimizer = bnb.optim.AdamW8bit(param_groups(model), min_8bit_size=1000)
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, **cfg))[0]
    monkeypatch.delenv(PADDING_ENV)
    assert engine.optimizer.bnb_padding_mode == mode
    return engine


def contents(folder: str, tag: str) -> dict:
    saved = SavedCheckpoint(os.path.join(folder, tag))
    out = {"param_shapes": saved.param_shapes(),
           "paddings": saved.optimizer_state(0)["param_alignment_paddings"]}
    for g, group in enumerate(saved.groups):
        for name, state, master in zip(group["param_names"], saved.param_states(g), saved.master_weights(g)):
            out[name] = {**state, "master": master}
    return out


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, one_rank, tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    cfg = CASES[request.param]
    engines = {mode: build(mode, monkeypatch, **cfg) for mode in (PARAM_PADDING, PADDING_TENSORS)}
    flat = {mode: [f.clone() for f in e.optimizer.bit16_groups_flat] for mode, e in engines.items()}
    losses = {mode: train_steps(e, range(3)) for mode, e in engines.items()}
    folder = str(tmp_path_factory.mktemp(request.param))
    for mode, engine in engines.items():
        engine.save_checkpoint(folder, tag=mode)
    continued = {mode: train_steps(e, range(3, 5)) for mode, e in engines.items()}  # the uninterrupted runs
    return request.param, cfg, engines, flat, {"trained": losses, "continued": continued}, folder, monkeypatch


def test_same_layout_same_numbers(pair):
    _, _, engines, flat, losses, _, _ = pair
    ours, theirs = engines[PADDING_TENSORS], engines[PARAM_PADDING]
    assert all(torch.equal(a, b) for a, b in zip(flat[PARAM_PADDING], flat[PADDING_TENSORS]))
    assert losses["trained"][PARAM_PADDING] == losses["trained"][PADDING_TENSORS]
    assert losses["continued"][PARAM_PADDING] == losses["continued"][PADDING_TENSORS]
    for p, q in zip(ours.module.parameters(), theirs.module.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(ours.optimizer.single_partition_of_fp32_groups, theirs.optimizer.single_partition_of_fp32_groups):
        assert torch.equal(a, b)
        assert same(dict(ours.optimizer.optimizer.state[a]), dict(theirs.optimizer.optimizer.state[b]))


def test_padding_tensors_stay_zero_and_out_of_sight(pair):
    _, _, engines, _, _, _, _ = pair
    zero = engines[PADDING_TENSORS].optimizer
    pads = [p for g in zero.round_robin_bit16_groups for p in g if padding_tensors.is_padding(p)]
    assert pads, "the toy model has parameters that do not end on a block boundary"
    assert all(p._hp_mapping is None and not p.any() for p in pads)
    assert [len(g) for g in zero.bnb_params] == [len(g) for g in engines[PARAM_PADDING].optimizer.bnb_params]
    for g, params in enumerate(zero.bnb_params):  # hp mappings of the model's parameters: DeepSpeed's weights API
        for p in params:
            assert torch.equal(p._hp_mapping.get_hp_fragment().view(-1),
                               deepspeed.utils.safe_get_full_fp32_param(p).view(-1))


def test_checkpoints_are_the_same_files(pair):
    _, _, _, _, _, folder, _ = pair
    assert same(contents(folder, PARAM_PADDING), contents(folder, PADDING_TENSORS))


@pytest.mark.parametrize("saved,loaded", [(PADDING_TENSORS, PARAM_PADDING), (PARAM_PADDING, PADDING_TENSORS)])
def test_each_loads_the_others_checkpoint(pair, saved, loaded):
    _, cfg, _, _, losses, folder, monkeypatch = pair
    engine = build(loaded, monkeypatch, **cfg)
    engine.load_checkpoint(folder, tag=saved)
    assert train_steps(engine, range(3, 5)) == losses["continued"][saved]


def test_control_without_the_tensors_the_layout_check_refuses(one_rank, monkeypatch):
    monkeypatch.setattr(padding_tensors, "place",
                        lambda zero, i, paddings, use_cpu_data: zero.round_robin_bit16_groups[i])
    with pytest.raises(RuntimeError, match="was not flattened block-aligned"):
        build(PADDING_TENSORS, monkeypatch, stage=2)
