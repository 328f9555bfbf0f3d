"""ZeRO-3's unscale/clip factor folded into the partition's step: the same factor, and the same training, as
DeepSpeed's own `unscale_and_clip_grads` multiplying each sub-group's gradient in a pass of its own.

The references are DeepSpeed's method itself, called on the same optimizer (the factor, for clipping norms, norms
below the bar and a loss scale alone), and an engine whose class has DeepSpeed's method back (weights and every
state byte after several clipped steps, several sub-groups, fp32 and bf16 master weights). Controls: clipping is
active in those steps (a run without it ends elsewhere), and the fold is what ran (the gradient is untouched before
the step, the factor is handed to it).
"""

import deepspeed
import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.optim.fused import partition_step
from deepspeed_bnb.runtime.zero import unscale_factor
from deepspeed_bnb.runtime.zero.compat import has_bf16_master
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
from support.bnb_optimizers import FACTORIES
from support.bnb_state import assert_same, engine_param_states as states
from support.toy import ds_config, gathered_weights as weights, make_model, param_groups, train_steps

STEPS = 4


def _engine(clip: float, bf16: bool = False, **zero):
    model = make_model(0, dtype=torch.bfloat16 if bf16 else torch.float32)
    config = ds_config(1, stage=3, clip=clip, bf16=bf16, sub_group_size=6000, **zero)  # several sub-groups
    return deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model)), config=config)[0]


def test_the_factor_handed_to_the_step_is_deepspeeds(one_rank, monkeypatch):
    engine = _engine(clip=0.05)
    opt = engine.optimizer
    partition = opt.fp32_partitioned_groups_flat[0]
    grad = torch.randn(partition.numel(), generator=torch.Generator().manual_seed(0))
    computed = []
    real = unscale_factor.combined_unscale_factor
    monkeypatch.setattr(unscale_factor, "combined_unscale_factor", lambda *a: computed.append(1) or real(*a))
    factors = {}
    for loss_scale, norm in ((1.0, 123.0), (1.0, 0.01), (8.0, 123.0), (8.0, 0.01)):
        monkeypatch.setattr(type(opt), "loss_scale", loss_scale, raising=False)
        partition.grad = grad.clone()
        opt.unscale_and_clip_grads(0, torch.tensor(norm))
        assert torch.equal(partition.grad, grad), "the gradient is scaled inside the step, not here"
        factor = opt._bnb_inv_scale.pop(0)
        assert factor.dtype == torch.float32 and factor.dim() == 0
        partition.grad = grad.clone()
        DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads(opt, 0, torch.tensor(norm))
        assert torch.equal(grad * factor, partition.grad)
        factors[(loss_scale, norm)] = float(factor)
    assert factors[(1.0, 123.0)] < 1.0 == factors[(1.0, 0.01)] and factors[(8.0, 0.01)] == 0.125  # control
    # one computation per norm tensor: DeepSpeed hands every sub-group the step's one norm
    computed.clear()
    norm = torch.tensor(123.0)
    for sub_group in range(len(opt.fp16_groups)):
        opt.fp32_partitioned_groups_flat[sub_group].grad = torch.zeros_like(opt.fp32_partitioned_groups_flat[sub_group])
        opt.unscale_and_clip_grads(sub_group, norm)
    assert len(opt.fp16_groups) > 1 and len(computed) == 1
    assert len({float(f) for f in opt._bnb_inv_scale.values()}) == 1
    opt._bnb_inv_scale.clear()
    for sub_group in range(len(opt.fp16_groups)):
        opt.fp32_partitioned_groups_flat[sub_group].grad = None


@pytest.mark.parametrize("master", ["fp32", pytest.param("bf16+8", marks=pytest.mark.skipif(
    not has_bf16_master(), reason=f"DeepSpeed {deepspeed.__version__} keeps no bf16 master weights (0.18.3 on)"))])
def test_clipped_training_equals_deepspeeds_own_unscale(one_rank, monkeypatch, master):
    """fp32 master weights (fp32 gradients): the fold is DeepSpeed's pass, bit for bit, weights and every state byte.
    Compensated bf16 master weights (bf16 gradients): bit for bit for every parameter with 32-bit state (bnb's own
    32-bit CPU arithmetic reads the gradient as DeepSpeed's pass rounds it to bf16); the 8-bit ones take the fp32
    product of gradient and factor on the CPU, unrounded (the IEEE arithmetic's definition, ops/reference.py, as at
    stages 1/2; bnb's CUDA arithmetic rounds as DeepSpeed's pass does), so from the second step on every gradient
    differs: one step is compared there."""
    bf16 = master != "fp32"
    steps = 1 if bf16 else STEPS
    zero = {"bnb_master_weights": master} if bf16 else {}
    runs, handed = {}, []
    real_step = partition_step.PartitionStep.step

    def recording(self, group, params, grads, state, inv_scale=None, master_error=None, **kwargs):
        handed.append(inv_scale)
        return real_step(self, group, params, grads, state, inv_scale, master_error, **kwargs)

    monkeypatch.setattr(partition_step.PartitionStep, "step", recording)
    for label, clip, stock_unscale in (("folded", 0.05, False), ("deepspeed", 0.05, True), ("no clip", 0.0, False)):
        with monkeypatch.context() as patch:
            if stock_unscale:  # DeepSpeed's method: its own pass over each gradient, nothing handed to the step
                patch.setattr(BnbZeroStage3Optimizer, "unscale_and_clip_grads",
                              DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads)
            engine = _engine(clip, bf16, **zero)
            assert "fused kernel" in engine.optimizer.bnb_update_summary()
            handed.clear()
            train_steps(engine, range(steps))
            runs[label] = weights(engine), states(engine), list(handed)
    (w, s, folded_factors), (w_ds, s_ds, ds_factors) = runs["folded"], runs["deepspeed"]
    assert folded_factors and all(f is not None for f in folded_factors)
    assert all(f is None for f in ds_factors)
    assert any(float(f) < 1.0 for f in folded_factors), "control: the clip is active in these steps"
    exact = [n for n in w if not bf16 or s[n]["state1"].dtype == torch.float32]
    assert exact and (not bf16 or len(exact) < len(w)), "both kinds of state are present"
    for name in exact:
        assert torch.equal(w[name], w_ds[name]), f"weights of {name}"
    for name in exact:
        assert_same(s[name], s_ds[name], name)
    assert not torch.equal(runs["no clip"][0]["fc1.weight"], w["fc1.weight"]), "control: clipping moved the weights"
