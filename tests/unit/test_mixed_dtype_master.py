"""fp32 trainable adapters on a frozen bf16 base (how PEFT keeps LoRA weights) under DeepSpeed's
`bf16_master_weights_and_grads`, ZeRO-3 and torch_autocast: the layout of DeepSpeed's own
`test_zero_autocast_mixed_dtype.py::TestZero3AutocastMixedDtype::test_fp32_adapter_with_bf16_base_params`, on one CPU
rank, with a bnb optimizer.

Stock DeepSpeed trains it (with bf16 master weights for the fp32 adapters). deepspeed_bnb once refused it, taking the
master dtype from the first parameter, with two suggested fixes that both failed. Now "auto" gives each run the master
weights of its trainable weights' dtype: fp32 here. Oracle: bitsandbytes' own AdamW8bit stepping fp32 copies of the
adapters with the gradients DeepSpeed computed. Control: the adapters moved, the frozen base did not. A mix of bf16
and fp32 trainable weights is refused, naming DeepSpeed's key, with fixes that each resolve.
"""

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.optim import master_weights

HIDDEN, RANK = 300, 4  # adapter_a is 1,200 elements: 8-bit state (min_8bit_size below)
MIN_8BIT = 1000


class AdaptedLinear(torch.nn.Module):
    """A frozen base weight and a rank-4 adapter beside it."""

    def __init__(self):
        super().__init__()
        self.base_weight = torch.nn.Parameter(torch.randn(HIDDEN, HIDDEN) * 0.01, requires_grad=False)

    def attach_fp32_adapter(self):
        """fp32 adapters made outside zero.Init and handed to ZeRO-3 as DeepSpeed's own test does."""
        self.adapter_a = torch.nn.Parameter(torch.randn(RANK, HIDDEN, dtype=torch.float32) * 0.01)
        self.adapter_b = torch.nn.Parameter(torch.randn(HIDDEN, RANK, dtype=torch.float32) * 0.01)
        self.base_weight.convert_to_zero_parameters([self.adapter_a, self.adapter_b])

    def forward(self, x, target):
        out = torch.nn.functional.linear(x, self.base_weight) + torch.nn.functional.linear(
            torch.nn.functional.linear(x, self.adapter_a), self.adapter_b)
        return torch.nn.functional.mse_loss(out.float(), target.float())


def config():
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
            # bnb's own update (the fused kernel's agreement with it is tests/kernels' concern)
            "zero_optimization": {"stage": 3, "memory_efficient_linear": False, "bnb_fused_kernel": False,
                                  "stage3_param_persistence_threshold": 0},
            "torch_autocast": {"enabled": True, "dtype": str(torch.bfloat16),
                               "lower_precision_safe_modules": [f"{__name__}.{AdaptedLinear.__name__}"]}}


def frozen_base(engine):
    """The frozen base weight, gathered (it has no fp32 master weights to read)."""
    with deepspeed.zero.GatheredParameters([engine.module.base_weight]):
        return engine.module.base_weight.detach().clone()


@pytest.fixture
def needs_autocast_zero3():
    try:
        import deepspeed.runtime.torch_autocast  # noqa: F401
    except ImportError:
        pytest.skip("this DeepSpeed release has no torch_autocast (ZeRO-3 keeps one parameter dtype)")


def test_fp32_adapters_on_a_bf16_base_train_with_fp32_master_weights_as_bnb_steps_them(one_rank,
                                                                                      needs_autocast_zero3):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config()):
        model = AdaptedLinear()
    model.attach_fp32_adapter()
    trainable = [model.adapter_a, model.adapter_b]
    engine = deepspeed.initialize(model=model, model_parameters=trainable, config=config(),
                                  optimizer=bnb.optim.AdamW8bit(trainable, lr=1e-2, min_8bit_size=MIN_8BIT))[0]
    assert engine.optimizer.bnb_master.mode == "fp32"
    names = ("adapter_a", "adapter_b")
    params = [getattr(engine.module, name) for name in names]
    assert [p.dtype for p in params] == [torch.float32] * 2 and engine.module.base_weight.dtype == torch.bfloat16
    before = [safe_get_full_fp32_param(p).clone() for p in params]
    base = frozen_base(engine)
    copies = [torch.nn.Parameter(w.clone()) for w in before]
    oracle = bnb.optim.AdamW8bit(copies, lr=1e-2, min_8bit_size=MIN_8BIT)
    for step in range(3):
        x, target = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
        engine.backward(engine(x, target))
        for copy, p in zip(copies, params):
            copy.grad = safe_get_full_grad(p).float().clone()
        engine.step()
        oracle.step()
        for name, copy, p in zip(names, copies, params):
            mine = safe_get_full_fp32_param(p)
            assert mine.dtype == torch.float32, name
            assert torch.allclose(mine, copy.detach(), rtol=0, atol=1e-6), \
                (name, step, (mine - copy.detach()).abs().max().item())
    assert all(not torch.equal(b, safe_get_full_fp32_param(p)) for b, p in zip(before, params))  # control: moved
    assert torch.equal(base, frozen_base(engine)) and base.abs().sum() > 0  # frozen (and gathered: not empty)
    assert oracle.state[copies[0]]["state1"].dtype == torch.uint8  # control: the 8-bit path was compared


def test_a_mix_of_bf16_and_fp32_trainable_weights_is_refused_with_fixes_that_resolve():
    mixed = {torch.bfloat16, torch.float32}
    with pytest.raises(ValueError, match=r"bf16.bf16_master_weights_and_grads: true .* several dtypes .* set "
                                         r"bf16.bf16_master_weights_and_grads to false"):
        master_weights.resolve("auto", True, mixed)
    assert master_weights.resolve("auto", False, mixed).mode == "fp32"  # the key set to false
    assert master_weights.resolve("auto", True, {torch.bfloat16}).mode == "bf16"  # one dtype: bf16
    assert master_weights.resolve("auto", True, {torch.float32}).mode == "fp32"  # one dtype: fp32
    with pytest.raises(ValueError, match=r"'bf16' keeps bf16 master weights, which needs bf16 trainable weights; "
                                         r"they are torch.float32.*remove zero_optimization.bnb_master_weights"):
        master_weights.resolve("bf16", True, {torch.float32})
