"""Optimizer-state keys are classified (element / block / whole / scalar), and a key that fits no class is an error.

Uses bnb's own init_state through the adapter's probe, plus a custom bnb subclass that adds keys of its own.
"""

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support.bnb_optimizers import FACTORIES
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.state_classes import StateClass, StateClassError
from support.toy import ds_config, global_batch, loss_fn, make_model, param_groups

E, B, W, S = StateClass.ELEMENT, StateClass.BLOCK, StateClass.WHOLE, StateClass.SCALAR


def probe(optimizer, eight_bit=True, keep_whole=("qmap1", "qmap2"), threshold=256):
    adapter = BnbAdapter(optimizer, keep_whole, threshold)
    keys = adapter.state_keys(optimizer.param_groups[0], 0, eight_bit, "cpu")
    return {k.name: k.cls for k in keys}


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_bnb_keys_get_their_classes(name):
    optimizer = FACTORIES[name]([torch.nn.Parameter(torch.zeros(4096))])
    eight_bit = "32bit" not in name
    classes = probe(optimizer, eight_bit)
    two_states = "state2" in classes
    expected = {"step": S, "state1": E}
    if two_states:
        expected["state2"] = E
    if eight_bit:
        expected.update({"qmap1": W, "absmax1": B})
        if two_states:
            expected.update({"qmap2": W, "absmax2": B})
    if name in ("LAMB8bit", "LARS8bit"):
        expected["unorm_vec"] = StateClass.SCRATCH
    assert classes == expected


class WithMap(bnb.optim.AdamW8bit):
    """A custom bnb optimizer holding one extra per-parameter tensor that is not element- or block-shaped."""

    extra_numel = 16

    def init_state(self, group, p, gindex, pindex):
        super().init_state(group, p, gindex, pindex)
        self.state[p]["my_map"] = torch.linspace(0, 1, self.extra_numel)


def with_map(numel):
    optimizer = WithMap([torch.nn.Parameter(torch.zeros(4096))])
    optimizer.extra_numel = numel
    return optimizer


def test_unknown_small_key_is_whole_by_threshold():
    assert probe(with_map(16))["my_map"] == W


def test_unknown_large_key_is_an_error_naming_key_and_knobs():
    with pytest.raises(StateClassError) as failure:
        probe(with_map(1000))
    message = str(failure.value)
    assert "'my_map'" in message and "bnb_keep_whole" in message and "bnb_keep_whole_threshold=256" in message


def test_keep_whole_list_or_threshold_accepts_it():
    assert probe(with_map(1000), keep_whole=("qmap1", "qmap2", "my_map"))["my_map"] == W
    assert probe(with_map(1000), threshold=1000)["my_map"] == W
    with pytest.raises(StateClassError, match="bnb_keep_whole_threshold=0"):
        probe(with_map(16), threshold=0)


def test_keep_whole_refuses_per_element_state():
    with pytest.raises(StateClassError, match="Remove 'state1' from bnb_keep_whole"):
        probe(bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(4096))]), keep_whole=("state1",))


def test_engine_keeps_the_custom_key_whole_and_trains(one_rank):
    """End to end: the extra key is one shared tensor for the partition, never sliced, and survives steps."""
    model = make_model()
    optimizer = WithMap(param_groups(model), min_8bit_size=1000)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=2))
    for step in range(2):
        tokens, targets = global_batch(step)
        engine.backward(loss_fn(engine, tokens, targets))
        engine.step()
    state = engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]
    assert torch.equal(state["my_map"], torch.linspace(0, 1, 16))
    assert engine.optimizer.bnb.stored_classes(state)["my_map"] == W


def test_engine_init_reports_unclassifiable_key(one_rank):
    model = make_model()
    optimizer = WithMap(param_groups(model), min_8bit_size=1000)
    optimizer.extra_numel = 1000
    with pytest.raises(StateClassError, match="'my_map'"):
        deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=2))


class WithWholeTensorOption(bnb.optim.AdamW8bit):
    """Reports one of bitsandbytes 0.49's whole-tensor options in its config, as 0.49's get_config does (0.50 removed
    `percentile_clipping` and `block_wise`, so this is the only way to exercise the check on 0.50)."""

    option: dict = {}

    def get_config(self, gindex, pindex, group):
        return {**super().get_config(gindex, pindex, group), **self.option}


@pytest.mark.parametrize("option,value,default", [("percentile_clipping", 5, 100), ("block_wise", False, True)])
def test_whole_tensor_options_are_refused_naming_the_option(option, value, default):
    """Their state (a gradient-norm history, one scale per tensor) needs the whole parameter, which ZeRO splits."""
    refused = WithWholeTensorOption([torch.nn.Parameter(torch.zeros(4096))])
    refused.option = {option: value}
    with pytest.raises(NotImplementedError) as failure:
        BnbAdapter(refused, ("qmap1", "qmap2"), 256)
    assert f"{option}={value!r}" in str(failure.value) and f"{option}={default!r}" in str(failure.value)
    accepted = WithWholeTensorOption([torch.nn.Parameter(torch.zeros(4096))])  # control: bnb's default passes
    accepted.option = {option: default}
    assert BnbAdapter(accepted, ("qmap1", "qmap2"), 256).eight_bit(accepted.param_groups[0]["params"][0])


def test_what_each_class_means_for_a_cut():
    """Element and block keys are cut with the parameter (block keys by whole blocks), the others are not."""
    assert {cls for cls in StateClass if cls.partitioned} == {StateClass.ELEMENT, StateClass.BLOCK}
    assert StateClass.ELEMENT.length(600) == 600 and StateClass.BLOCK.length(600) == 3
    assert StateClass.WHOLE.length(600) is None and StateClass.SCALAR.length(600) is None
    values = torch.arange(2 * 1024).reshape(2, 1024)  # two rows (AdEMAMix's state1)
    assert torch.equal(StateClass.ELEMENT.narrow(values, 512, 300), values[:, 512:812])
    assert torch.equal(StateClass.BLOCK.narrow(values, 512, 300), values[:, 2:4])  # elements 512..811: blocks 2, 3
    with pytest.raises(ValueError, match="whole state is not cut"):
        StateClass.WHOLE.narrow(values, 0, 256)
