"""DeepSpeed's parameter-level optimizer-state API under BnbZeroOptimizer, on one in-process rank.

`deepspeed.utils.safe_{get,set}_{full,local}_optimizer_state` take and give a parameter's fp32 moments
(deepspeed_bnb/utils/tensor_fragment.py). Here: a set followed by a get returns every value within half a
quantization step, measured against the gap between the two codes of bnb's own map around each value, with the
block's absmax taken from the values themselves (controls: a quantizer with the wrong blocks, and a stale absmax, both
break the bound); fp32-state parameters round-trip exactly; a set touches nothing but its own state; keys without
per-element meaning and values 8-bit state cannot hold are refused with messages naming them, before anything is
written; parameters of other engines keep DeepSpeed's behaviour. Agreement with plain bitsandbytes is checked in
test_matches_bnb.py; two ranks (a parameter split across them, full vs local, checkpoints reloaded at the same and
another DP size) in test_distributed.py.
"""

import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support.bnb_optimizers import FACTORIES
from support.bnb_state import step_ratio
from deepspeed.utils import (safe_get_full_optimizer_state, safe_get_local_optimizer_state,
                             safe_set_full_optimizer_state, safe_set_local_optimizer_state)
from deepspeed_bnb.ops.reference import quantize_blockwise
from deepspeed_bnb.utils import tensor_fragment
from support.toy import MIN_8BIT_SIZE, ds_config, make_model, moment_values, param_groups, train_steps

ROUND_TRIP = {  # optimizer -> (name, holds squares: bnb's unsigned map) to set and get back
    "AdamW8bit": (("exp_avg", False), ("exp_avg_sq", True)),
    "AdEMAMix8bit": (("state1", False), ("exp_avg_slow", False), ("state2", True)),  # state1: (2, *shape)
}
HALF = 0.5  # of a quantization step: what rounding to the nearest code guarantees


def build(name, stage=2, **config):
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FACTORIES[name](param_groups(model)),
                                      config=ds_config(1, stage=stage, **config))
    return engine


def full_shape(engine, p, key):
    return (2, *p.shape) if key == "state1" and "AdEMAMix" in type(engine.optimizer.optimizer).__name__ else p.shape


def all_gets(engine, keys):
    return {(n, k): safe_get_full_optimizer_state(p, k) for n, p in engine.module.named_parameters() for k in keys}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_set_then_get_within_half_a_step(one_rank, name):
    engine = build(name)
    train_steps(engine, range(2))
    keys = [k for k, _ in ROUND_TRIP[name]]
    worst = 0.0
    for pname, p in engine.module.named_parameters():
        for key, unsigned in ROUND_TRIP[name]:
            shape = full_shape(engine, p, key)
            if key == "state1":  # AdEMAMix's EMAs as one (2, *shape) tensor
                values = moment_values(f"{pname}.{key}", (2, p.numel()), unsigned).reshape(shape)
            else:
                values = moment_values(f"{pname}.{key}", shape, unsigned)
            before = all_gets(engine, keys)
            safe_set_full_optimizer_state(p, values, key)
            got = safe_get_full_optimizer_state(p, key)
            assert got.dtype == torch.float32 and got.shape == values.shape, f"{pname}.{key}"
            if p.numel() >= MIN_8BIT_SIZE:
                ratio = step_ratio(got, values, unsigned, p.numel())
                assert ratio <= HALF, f"{pname}.{key}: {ratio} of a quantization step"
                worst = max(worst, ratio)
            else:
                assert torch.equal(got, values), f"{pname}.{key}: fp32 state is a plain copy"
            local = safe_get_local_optimizer_state(p, key)  # DP=1: the whole parameter, flattened
            assert torch.equal(local, got.reshape(local.shape)) and local.shape[-1] == p.numel()
            # nothing else moved: every other parameter and key, and the other rows of AdEMAMix's state1
            for (other, k), value in all_gets(engine, keys).items():
                touched = other == pname and (k == key or {k, key} <= {"state1", "exp_avg_slow"})
                if not touched:
                    assert torch.equal(value, before[(other, k)]), f"setting {pname}.{key} changed {other}.{k}"
            if key == "exp_avg_slow":
                assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), before[(pname, "state1")][0])
                assert torch.equal(got, safe_get_full_optimizer_state(p, "state1")[1])
    assert worst > 0.45, "the measure must see rounding at all"  # measured: 0.500 (AdamW8bit and AdEMAMix8bit)


def test_controls_wrong_blocks_and_stale_absmax_break_the_bound(one_rank, monkeypatch):
    """The bound above is not vacuous: a quantizer that scales a whole fragment as one block, or codes written next
    to the absmax of the values they replaced, miss it by far."""
    engine = build("AdamW8bit")
    train_steps(engine, range(2))
    p = engine.module.fc1.weight
    values = moment_values("fc1.weight.exp_avg", p.shape)
    safe_set_full_optimizer_state(p, values, "exp_avg")
    assert step_ratio(safe_get_full_optimizer_state(p, "exp_avg"), values, False, p.numel()) <= HALF

    def one_block(values, qmap, block=256):  # the fragment quantized as a single block: small blocks lose everything
        codes, absmax = quantize_blockwise(values, qmap, block=values.numel())
        return codes, absmax.expand(-(-values.numel() // block)).clone()

    monkeypatch.setattr(tensor_fragment, "quantize_blockwise", one_block)
    safe_set_full_optimizer_state(p, values, "exp_avg")
    assert step_ratio(safe_get_full_optimizer_state(p, "exp_avg"), values, False, p.numel()) > 10
    monkeypatch.undo()

    state = engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]
    stale = state["absmax1"].clone()  # the absmax of the values set above
    halved = values / 2
    safe_set_full_optimizer_state(p, halved, "exp_avg")
    assert step_ratio(safe_get_full_optimizer_state(p, "exp_avg"), halved, False, p.numel()) <= HALF
    state["absmax1"].copy_(stale)  # new codes, old scale
    assert step_ratio(safe_get_full_optimizer_state(p, "exp_avg"), halved, False, p.numel()) > 10


def refusal(call, *needles):
    with pytest.raises(ValueError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in: {info.value}"


def test_refusals_name_key_parameter_optimizer_and_keys(one_rank):
    engine = build("AdamW8bit")
    train_steps(engine, range(2))
    w, b = engine.module.fc1.weight, engine.module.head.bias  # 8-bit state, fp32 state
    keys = "state1, state2, exp_avg, exp_avg_sq"
    get = safe_get_full_optimizer_state
    refusal(lambda: get(w, "absmax1"), "'absmax1'", "fc1.weight", "8-bit state", "AdamW8bit", "256-element block", keys)
    refusal(lambda: get(b, "absmax1"), "head.bias", "fp32 state", "only 8-bit-state parameters have it", keys)
    refusal(lambda: get(w, "qmap2"), "'qmap2'", "quantization map shared by every parameter", keys)
    refusal(lambda: safe_get_local_optimizer_state(w, "step"), "'step'", "whole param group (now 2)", keys)
    refusal(lambda: get(w, "exp_avg_slow"), "'exp_avg_slow'", "not a per-element state of this optimizer", keys)
    refusal(lambda: get(w, "fp32.state1"), "'fp32.state1'", keys)  # internal storage names are not keys

    before = all_gets(engine, ("exp_avg", "exp_avg_sq"))
    good = moment_values("x", w.shape)
    refusal(lambda: safe_set_full_optimizer_state(w, good[:-1], "exp_avg"), "fc1.weight", "(301, 40)", "(300, 40)")
    refusal(lambda: safe_set_local_optimizer_state(w, good.flatten()[:-1], "exp_avg"), "this rank's fragment",
            "12040 values", "12039")
    nan = good.clone()
    nan[7, 3] = float("nan")
    refusal(lambda: safe_set_full_optimizer_state(w, nan, "exp_avg"), "1 non-finite values", "'exp_avg'", "fc1.weight")
    refusal(lambda: safe_set_full_optimizer_state(w, good, "exp_avg_sq"), "negative values", "'exp_avg_sq'",
            "unsigned 8-bit map")
    refusal(lambda: safe_set_full_optimizer_state(w, good, "absmax1"), "'absmax1'", keys)
    after = all_gets(engine, ("exp_avg", "exp_avg_sq"))
    assert all(torch.equal(after[k], before[k]) for k in before), "a refused set must write nothing"
    safe_set_full_optimizer_state(b, moment_values("y", b.shape), "exp_avg")  # fp32 state takes any sign: a copy


@pytest.mark.parametrize("name,names", [("Lion8bit", "state1, exp_avg"),
                                        ("SGD8bit_momentum", "state1, momentum_buffer")])
def test_one_state_rules_name_their_momentum(one_rank, name, names):
    """Lion's momentum is DeepSpeed FusedLion's exp_avg; SGD's (m = beta * m + g, a sum, no average) is torch's
    momentum_buffer, and not exp_avg."""
    engine = build(name)
    train_steps(engine, range(1))
    p = engine.module.fc1.weight
    assert sorted(p._hp_mapping.get_optim_state_keys()) == sorted(names.split(", "))
    alias = names.split(", ")[1]
    assert torch.equal(safe_get_full_optimizer_state(p, alias), safe_get_full_optimizer_state(p, "state1"))
    missing = "exp_avg_sq" if name.startswith("Lion") else "exp_avg"
    refusal(lambda: safe_get_full_optimizer_state(p, missing), f"'{missing}'", name.split("_")[0], names)


@pytest.mark.parametrize("config", [dict(bf16=True), dict(offload=True), dict(stage=1)])
def test_bf16_offload_stage1(one_rank, config):
    """bf16 parameters get fp32 state of their shape; under offload the state lives on the CPU, beside the param's."""
    engine = build("AdamW8bit", **config)
    train_steps(engine, range(1))
    p = engine.module.fc1.weight
    assert p.dtype == (torch.bfloat16 if config.get("bf16") else torch.float32)
    values = moment_values("config.exp_avg", p.shape)
    safe_set_full_optimizer_state(p, values, "exp_avg")
    got, local = safe_get_full_optimizer_state(p, "exp_avg"), safe_get_local_optimizer_state(p, "exp_avg")
    assert got.dtype == local.dtype == torch.float32 and got.shape == p.shape and local.device == p.device
    assert step_ratio(got, values, False, p.numel()) <= HALF and torch.equal(local, got.flatten())


def test_other_engines_keep_deepspeeds_behaviour(one_rank):
    """Only BnbZeroOptimizer's parameters are answered differently: a torch AdamW engine's are DeepSpeed's own."""
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=ds_config(1, stage=2))
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    train_steps(engine, range(1))
    p = engine.module.fc1.weight
    flat = engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]["exp_avg"]
    start = p._hp_mapping.hp_fragment_address.start
    assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg").flatten(), flat[start:start + p.numel()])
    with pytest.raises(AssertionError, match="only defined for ZeRO-3"):
        safe_get_local_optimizer_state(p, "exp_avg")
