"""DeepSpeed's arguments reach deepspeed_bnb's ZeRO optimizers by name, whatever a release inserts in its signature.

DeepSpeed releases insert parameters in the middle of the ZeRO optimizers' `__init__` (`gradient_average`, before
`gradient_accumulation_steps`). The subclasses bind what the engine passed to the installed release's own signature
(runtime/zero/compat.by_name), read their settings from that, and pass everything on by keyword.
- by_name, on two signatures a release apart, maps each release's positional call to the same names; control: the
  same call passed on by position into the newer signature lands values on the wrong parameters.
- A real engine whose ZeRO optimizer is called with every argument by position (DeepSpeed's own engine passes most by
  keyword) builds the same optimizer and steps to the same weights, bit for bit, as the keyword call, at ZeRO-2 and 3,
  with DeepSpeed's bf16 master-weight key (which the subclass reads); control: the positional call did happen.
"""

import inspect

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.runtime import engine as bnb_engine
from deepspeed_bnb.runtime.zero.compat import by_name
from support.toy import MIN_8BIT_SIZE, ds_config, make_model, param_groups, train_steps


def before(self, init_optimizer, param_names, timers, postscale_gradients=True, gradient_predivide_factor=1.0,
           gradient_accumulation_steps=1, ignore_unused_parameters=True):
    pass


def after(self, init_optimizer, param_names, timers, postscale_gradients=True, gradient_predivide_factor=1.0,
          gradient_average=True, gradient_accumulation_steps=1, ignore_unused_parameters=True):
    pass


def test_each_release_positional_call_binds_to_the_same_names():
    old_call = ("opt", ["w"], "timers", True, 2.0, 4, False)
    new_call = ("opt", ["w"], "timers", True, 2.0, True, 4, False)
    for signature, call in ((before, old_call), (after, new_call)):
        named = by_name(signature, call, {})
        assert named["gradient_accumulation_steps"] == 4 and named["ignore_unused_parameters"] is False
        assert named["init_optimizer"] == "opt" and "self" not in named
    assert by_name(after, old_call[:4], {"gradient_accumulation_steps": 4}) == {
        "init_optimizer": "opt", "param_names": ["w"], "timers": "timers", "postscale_gradients": True,
        "gradient_accumulation_steps": 4}


def test_control_passing_positions_on_shifts_them():
    """What binding by name prevents: a call made for the older signature, passed on by position into the newer."""
    shifted = inspect.signature(after).bind(None, "opt", ["w"], "timers", True, 2.0, 4, False).arguments
    assert shifted["gradient_average"] == 4 and shifted["gradient_accumulation_steps"] is False


def test_a_signature_with_star_args_is_refused_by_name():
    def star(self, init_optimizer, *rest):
        pass

    with pytest.raises(TypeError, match=r"star takes \*rest: its arguments cannot be passed on by name"):
        by_name(star, ("opt", 1, 2), {})


def _train(stage: int, positional: bool, monkeypatch):
    """Weights after 3 steps of a bf16 model with DeepSpeed's bf16 master-weight key, and how the optimizer was
    called (the arguments that came by position)."""
    swap, ours = bnb_engine._ZERO_CLASSES[stage]
    stock_init = {2: deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer,
                  3: deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3}[stage].__init__
    calls = []

    class ByPosition(ours):
        def __init__(self, *args, **kwargs):
            """The engine's call with every DeepSpeed argument moved to its position in the release's signature."""
            ours_only = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("bnb_")}
            bound = inspect.signature(stock_init).bind(None, *args, **kwargs)
            bound.apply_defaults()  # every parameter up to the last one given, defaults included, by position
            positions = list(bound.args)[1:]
            calls.append(len(positions))
            super().__init__(*positions, **ours_only)

    if positional:
        monkeypatch.setitem(bnb_engine._ZERO_CLASSES, stage, (swap, ByPosition))
    model = make_model(0, dtype=torch.bfloat16)
    optimizer = bnb.optim.AdamW8bit(param_groups(model), min_8bit_size=MIN_8BIT_SIZE)
    config = ds_config(1, stage=stage, bf16=True, bf16_master=True)
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    assert isinstance(engine.optimizer, ours) and engine.optimizer.bnb_master.mode == "bf16"
    train_steps(engine, range(3))
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
        weights = [p.detach().clone() for p in model.parameters()]
    engine.destroy()
    return weights, calls


@pytest.mark.parametrize("stage", [2, 3])
def test_positional_call_builds_and_steps_as_the_keyword_call(one_rank, stage, monkeypatch):
    by_keyword, none = _train(stage, positional=False, monkeypatch=monkeypatch)
    by_position, calls = _train(stage, positional=True, monkeypatch=monkeypatch)
    assert none == [] and len(calls) == 1 and calls[0] > 10  # control: every DeepSpeed argument came by position
    assert len(by_keyword) == len(by_position)
    for a, b in zip(by_keyword, by_position):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert not torch.equal(by_keyword[0], make_model(0, dtype=torch.bfloat16).emb.weight)  # it trained
