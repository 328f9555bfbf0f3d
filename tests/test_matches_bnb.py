"""ZeRO at DP=1 gives per-parameter state and weights equal to plain bitsandbytes on the same model and data.

Each bnb optimizer family runs through deepspeed.initialize (one CPU rank, ZeRO-2, two param groups with different
lr / weight decay, 8-bit and fp32 state side by side) and, independently, as a plain bnb optimizer on a copy of the
model. Per-parameter overrides registered with bnb's GlobalOptimManager apply as in plain bnb (control: without them
the run differs). Control: stock DeepSpeed ZeRO with the same bnb optimizer does not match. With the fused kernel (the
default for Adam-family, Lion and SGD-momentum optimizers), ZeRO equals the kernel's reference applied to each
parameter on its own.
"""

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from bnb_optimizers import FACTORIES
from deepspeed_bnb.checkpoint.param_state import gather_param_states
from deepspeed_bnb.runtime.engine import stock_deepspeed
from deepspeed_bnb.ops import adam8bit, reference
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.state_layout import GroupLayout
from toy import MIN_8BIT_SIZE, clone, ds_config, global_batch, loss_fn, make_model, param_groups, train_steps

STEPS = 3
FUSED_FACTORIES = {**FACTORIES, "SGD_32bit_momentum": lambda p: bnb.optim.SGD(p, lr=1e-2, momentum=0.9,
                                                                              min_8bit_size=1000)}


def train_plain(model, optimizer):
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        loss_fn(model, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def engine_param_states(engine):
    """model parameter -> bnb-style state, gathered from the engine's flat partition (DP=1: one rank)."""
    opt, out = engine.optimizer, {}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        state = opt.optimizer.state[opt.single_partition_of_fp32_groups[i]]
        per_param = gather_param_states(opt.bnb_layouts[i], opt.bnb_eight_bit[i], opt.bnb.stored_classes(state),
                                        [state])
        out.update({p: s for p, s in zip(params, per_param)})
    return out


def flat_bnb_state(state, numel):
    """Plain bnb's state of one parameter, flattened like the gathered state: (rows..., numel) / (rows..., blocks)."""
    out = {}
    for key, value in state.items():
        if key == "unorm_vec":
            continue  # scratch: written by each step, never carried to the next
        if key in ("state1", "state2"):
            value = value.reshape(-1, numel)  # AdEMAMix keeps two rows (fast and slow EMA)
            value = value[0] if value.shape[0] == 1 else value
        out[key] = value
    return out


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_zero_dp1_matches_plain_bnb(one_rank, name):
    model = make_model(0)
    reference = clone(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FACTORIES[name](param_groups(model)),
                                      config=ds_config(1, stage=2, bnb_fused_kernel=False))  # bnb's own update
    assert type(engine.optimizer).__name__ == "BnbZeroOptimizer"
    plain = FACTORIES[name](param_groups(reference))
    train_steps(engine, range(STEPS))
    train_plain(reference, plain)

    assert_equals_plain(engine, model, reference, plain, name)
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), make_model(0).parameters()))


def assert_equals_plain(engine, model, reference, plain, label):
    """The ZeRO run's weights and every parameter's state (values and dtypes) equal plain bnb's; returns the state."""
    states = engine_param_states(engine)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{label}: weights of {pname} differ"
        mine, theirs = states[p], flat_bnb_state(plain.state[q], q.numel())
        assert mine.keys() == theirs.keys(), pname
        for key in mine:
            if torch.is_tensor(mine[key]):
                assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), f"{pname}.{key}"
            else:
                assert mine[key] == theirs[key], f"{pname}.{key}"
    return states


def test_control_stock_zero_differs_from_plain_bnb(one_rank):
    model = make_model(0)
    reference = clone(model)
    with stock_deepspeed():  # stock DeepSpeed wants bnb optimizers flagged as untested
        engine, *_ = deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model)),
                                          config={**ds_config(1, stage=2), "zero_allow_untested_optimizer": True})
    assert type(engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
    plain = FACTORIES["AdamW8bit"](param_groups(reference))
    train_steps(engine, range(STEPS))
    train_plain(reference, plain)
    assert any(not torch.equal(p.detach(), q.detach()) for p, q in zip(model.parameters(), reference.parameters()))


def with_overrides(model, groups, overrides: bool):
    """bnb's GlobalOptimManager overrides for this model: 32-bit state for fc1.weight (override_config, before
    register_parameters, which bnb 0.49 and 0.50 both honour) and another lr for head.weight (a module override)."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()
    if overrides:
        manager.override_config(model.fc1.weight, "optim_bits", 32)
        manager.register_parameters(groups)
        manager.register_module_override(model.head, "weight", {"lr": 5e-3})
    return groups


def test_per_parameter_overrides_match_plain_bnb(one_rank):
    """Overrides registered per model parameter apply to that parameter's segments under ZeRO as in plain bnb."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    runs = {}
    try:
        for overrides in (True, False):
            model = make_model(0)
            reference = clone(model)
            optimizer = FACTORIES["AdamW8bit"](with_overrides(model, param_groups(model), overrides))
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                              config=ds_config(1, stage=2, bnb_fused_kernel=False))
            plain = FACTORIES["AdamW8bit"](with_overrides(reference, param_groups(reference), overrides))
            train_steps(engine, range(STEPS))
            train_plain(reference, plain)
            runs[overrides] = (model, assert_equals_plain(engine, model, reference, plain, f"overrides={overrides}"))
    finally:
        manager.initialize()
    (model, states), (control, control_states) = runs[True], runs[False]
    assert states[model.fc1.weight]["state1"].dtype == torch.float32  # the override took effect ...
    assert control_states[control.fc1.weight]["state1"].dtype == torch.uint8  # ... and is not the default
    assert not torch.equal(model.head.weight.detach(), control.head.weight.detach())  # the lr override moved it


def test_fused_unscale_factor_is_deepspeeds(one_rank):
    """The unscale/clip factor handed to the fused kernel is the one DeepSpeed's own unscale_and_clip_grads multiplies
    the gradient partition by, for clipping norms, norms below the bar and invalid norms (inf, NaN, -1)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model)),
                                      config=ds_config(1, stage=2, clip=0.05))
    opt = engine.optimizer
    partition = opt.single_partition_of_fp32_groups[0]
    grad = torch.randn(partition.numel(), generator=torch.Generator().manual_seed(0))
    factors = {}
    for norm in (123.0, 0.01, float("inf"), float("nan"), -1.0):
        partition.grad = grad.clone()
        opt.unscale_and_clip_grads([partition.grad], torch.tensor(norm))
        assert torch.equal(partition.grad, grad), "a fused group's gradient is scaled inside the kernel, not here"
        factors[norm] = opt._bnb_inv_scale.pop(0)
        theirs = grad.clone()
        DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, [theirs], torch.tensor(norm))
        torch.testing.assert_close(grad * factors[norm], theirs, rtol=0, atol=0, equal_nan=True)
    assert factors[123.0] < 1.0 and factors[0.01] == 1.0  # control: clipping is active for the large norm only
    partition.grad = None


class PerParameterReference:
    """The fused step's reference applied to each parameter alone (its own one-segment partition): no ZeRO at all."""

    def __init__(self, optimizer):
        self.optimizer, self.state = optimizer, {}
        self.qmap1 = bnb.functional.create_dynamic_map(signed=True)
        self.qmap2 = bnb.functional.create_dynamic_map(signed=False)
        self.rule = optimizer.optimizer_name

    def step(self, t):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                n = p.numel()
                eight_bit = self.optimizer.args.optim_bits == 8 and n >= MIN_8BIT_SIZE
                if p not in self.state:
                    self.state[p] = [torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8),
                                     torch.zeros(-(-n // 256)), torch.zeros(-(-n // 256)),
                                     torch.zeros(0 if eight_bit else n), torch.zeros(0 if eight_bit else n)]
                table = adam8bit.segment_table(GroupLayout((n,), 1).segments(0, [eight_bit]), [0])
                flat, state = p.data.view(-1), self.state[p]
                if self.rule == "momentum":  # one state, as Lion; bnb's step counter picks the step-1 rule
                    hyper = adam8bit.hyper_table([MomentumHyper.momentum(group["lr"], group["betas"][0],
                                                                         group["weight_decay"], t)])
                    reference.momentum8bit_step(flat, p.grad.view(-1), state[0], state[2], state[4], self.qmap1,
                                                table, hyper, 1.0)
                elif self.rule == "lion":  # one state: codes1, absmax1, fp32 state1
                    hyper = adam8bit.hyper_table([LionHyper.lion(group["lr"], *group["betas"], group["weight_decay"])])
                    reference.lion8bit_step(flat, p.grad.view(-1), state[0], state[2], state[4], self.qmap1, table,
                                            hyper, 1.0)
                else:
                    hyper = adam8bit.hyper_table([AdamHyper.adamw(group["lr"], *group["betas"], group["eps"],
                                                                  group["weight_decay"], t)])
                    reference.adam8bit_step(flat, p.grad.view(-1), *state, self.qmap1, self.qmap2, table, hyper, 1.0)
                p.grad = None


@pytest.mark.parametrize("name", ["AdamW8bit", "Adam8bit", "AdamW_32bit", "Lion8bit", "Lion_32bit",
                                  "SGD8bit_momentum", "SGD_32bit_momentum"])
def test_fused_zero_dp1_matches_per_parameter_reference(one_rank, name):
    """The fused kernel under ZeRO (default bnb_fused_kernel: auto) equals its reference run on each parameter alone;
    its per-parameter state has plain bnb's keys, dtypes and shapes (checkpoints load with either path)."""
    model = make_model(0)
    copy, bnb_copy = clone(model), clone(model)
    factory = FUSED_FACTORIES[name]
    engine, *_ = deepspeed.initialize(model=model, optimizer=factory(param_groups(model)), config=ds_config(1, stage=2))
    assert all(f is not None for f in engine.optimizer.bnb_fused), "Adam, Lion, SGD-momentum step fused by default"
    per_parameter = PerParameterReference(factory(param_groups(copy)))
    plain = factory(param_groups(bnb_copy))
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        engine.backward(loss_fn(engine, tokens, targets))
        engine.step()
        loss_fn(copy, tokens, targets).backward()
        per_parameter.step(step + 1)
    train_plain(bnb_copy, plain)
    states = engine_param_states(engine)
    for (pname, p), q, r in zip(model.named_parameters(), copy.parameters(), bnb_copy.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{name}: weights of {pname} differ"
        mine, theirs = states[p], flat_bnb_state(plain.state[r], r.numel())
        assert mine.keys() == theirs.keys(), pname
        for key in mine:
            assert type(mine[key]) is type(theirs[key]), f"{pname}.{key}"
            if torch.is_tensor(mine[key]):
                assert (mine[key].dtype, mine[key].shape) == (theirs[key].dtype, theirs[key].shape), f"{pname}.{key}"
    if name.startswith("Lion"):
        # tracks bnb's own update: each step moves an element by lr * sign (or not at all), so the two can drift
        # apart by at most 2 * lr per step, where the signs differ (near-zero directions, zero-gradient embedding
        # rows that bnb's CPU quantizer cannot keep at 0); elsewhere they agree exactly
        lr = max(g["lr"] for g in param_groups(model))
        mine, theirs = torch.cat([p.detach().flatten() for p in model.parameters()]), \
            torch.cat([r.detach().flatten() for r in bnb_copy.parameters()])
        start = torch.cat([p.detach().flatten() for p in make_model(0).parameters()])
        assert (mine - theirs).abs().max() <= 2 * lr * STEPS * (1 + 1e-3)
        assert (mine == theirs).float().mean() > 0.9, "the update agrees with bnb's for most elements"
        assert (mine != start).float().mean() > 0.9, "control: most elements moved"
    if name.startswith("SGD"):
        # tracks bnb's own update closely: the two differ only by the rounding of the stored momentum (8-bit: a code
        # apart at most, fp32: bnb's own operation order), a small fraction of the distance the weights moved
        # (measured after 3 steps: max difference 1.5e-5 vs 2.3e-3 moved, 98.7% of elements identical for SGD8bit;
        # 6e-8 and 99.4% for 32-bit SGD)
        mine, theirs = torch.cat([p.detach().flatten() for p in model.parameters()]), \
            torch.cat([r.detach().flatten() for r in bnb_copy.parameters()])
        start = torch.cat([p.detach().flatten() for p in make_model(0).parameters()])
        moved = (theirs - start).abs()
        assert (mine - theirs).abs().max() <= 0.02 * moved.max(), f"{(mine - theirs).abs().max()} vs {moved.max()}"
        assert (mine == theirs).float().mean() > 0.9, "the update agrees with bnb's for most elements"
        assert (moved > 0).float().mean() > 0.9, "control: most elements moved"
