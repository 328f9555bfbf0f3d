"""The zero_optimization.bnb_* keys validate wherever DeepSpeed parses a config; typos and bad values are refused."""

import json

import bitsandbytes as bnb
import deepspeed
import pytest
from deepspeed.runtime.config import DeepSpeedConfig

import deepspeed_bnb  # noqa: F401
from support.toy import make_model, param_groups


def config(**zero):
    return {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, **zero}}


def test_keys_accepted_by_deepspeed_config_built_directly():
    """What HF Trainer (HfDeepSpeedConfig) and Accelerate do: build DeepSpeedConfig themselves."""
    parsed = DeepSpeedConfig(config(bnb_keep_whole=["qmap1", "qmap2", "my_map"], bnb_keep_whole_threshold=64))
    assert parsed.zero_config.bnb_keep_whole == ["qmap1", "qmap2", "my_map"]
    assert parsed.zero_config.bnb_keep_whole_threshold == 64
    defaults = DeepSpeedConfig(config()).zero_config
    assert defaults.bnb_keep_whole == ["qmap1", "qmap2"] and defaults.bnb_keep_whole_threshold == 256


def test_typo_still_rejected():
    with pytest.raises(Exception, match="bnb_keep_hole"):
        DeepSpeedConfig(config(bnb_keep_hole=["qmap1"]))


@pytest.mark.parametrize("key,value,needle", [
    ("bnb_keep_whole_threshold", -1, "non-negative integer"),
    ("bnb_keep_whole_threshold", True, "non-negative integer"),
    ("bnb_keep_whole_threshold", "256", "non-negative integer"),
    ("bnb_keep_whole_threshold", 2.5, "non-negative integer"),
    ("bnb_keep_whole", "qmap1", "list of optimizer-state key names"),
    ("bnb_keep_whole", ["qmap1", 3], "list of optimizer-state key names"),
    ("bnb_fused_kernel", "yes", '"auto", true or false'),
])
def test_bad_values_name_key_and_accepted_values(one_rank, tmp_path, key, value, needle):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(**{key: value})))
    model = make_model()
    for cfg in (config(**{key: value}), str(path)):  # a dict and a JSON file
        with pytest.raises(Exception) as failure:
            deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)), config=cfg)
        assert key in str(failure.value) and needle in str(failure.value)


def test_keep_whole_reaches_the_optimizer(one_rank):
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)),
                                      config=config(bnb_keep_whole=["qmap1", "qmap2", "extra"],
                                                    bnb_keep_whole_threshold=7))
    assert engine.optimizer.bnb.keep_whole == {"qmap1", "qmap2", "extra"}
    assert engine.optimizer.bnb.keep_whole_threshold == 7


def test_other_optimizers_keep_stock_behaviour(one_rank):
    import torch
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                      config={**config(), "zero_allow_untested_optimizer": True})
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"


def test_fused_kernel_setting(one_rank):
    """`auto` fuses the 8-bit parameters of rules with a kernel, `true` requires a kernel for the rule, `false` never
    fuses (which parameters and why: tests/kernels/test_fused_contract.py, tests/unit/test_routing.py)."""
    assert DeepSpeedConfig(config()).zero_config.bnb_fused_kernel == "auto"
    model = make_model()

    def fused_rules(optimizer, **zero):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(**zero))
        return [step.fused.rule if step.fused else None for step in engine.optimizer.bnb_steps]

    # param group 1 holds only small parameters (bnb's default min_8bit_size: 32-bit state), which the kernel steps in
    # bnb's own 32-bit CPU arithmetic (ops/rules.py: bnb_cpu); no fused kernel for RMSprop: bnb's own update
    assert fused_rules(bnb.optim.RMSprop8bit(param_groups(model), lr=1e-3), bnb_fused_kernel="auto") == [None, None]
    with pytest.raises(ValueError, match="bnb_fused_kernel: true.*'rmsprop'.*auto"):
        fused_rules(bnb.optim.RMSprop8bit(param_groups(model), lr=1e-3), bnb_fused_kernel=True)
    sgd = bnb.optim.SGD8bit(param_groups(model), lr=1e-2, momentum=0.9)
    assert fused_rules(sgd, bnb_fused_kernel=True) == ["momentum", "momentum"]
    assert fused_rules(bnb.optim.Lion8bit(param_groups(model)), bnb_fused_kernel=True) == ["lion", "lion"]
    assert fused_rules(bnb.optim.AdamW8bit(param_groups(model))) == ["adam", "adam"]
    assert fused_rules(bnb.optim.AdamW8bit(param_groups(model)), bnb_fused_kernel=False) == [None, None]
