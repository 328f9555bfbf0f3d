"""ZeRO at DP=1 gives per-parameter state and weights equal to plain bitsandbytes on the same model and data.

Each bnb optimizer family runs through deepspeed.initialize (one CPU rank, ZeRO-2, two param groups with different
lr / weight decay, 8-bit and fp32 state side by side) and, independently, as a plain bnb optimizer on a copy of the
model. DeepSpeed's parameter-level API (safe_get_full/local_optimizer_state) returns plain bnb's state dequantized by
bnb's own dequantize_blockwise, bit for bit, under bnb's and torch's names. Per-parameter overrides registered with
bnb's GlobalOptimManager apply as in plain bnb (control: without them the run differs). Control: stock DeepSpeed ZeRO
with the same bnb optimizer does not match, and its API hands out 8-bit codes and knows no `exp_avg`. With the
default settings, 8-bit parameters of Adam-family, Lion and SGD-momentum optimizers get the fused kernel (equal to its
reference applied to each parameter on its own), and every other parameter bnb's own update (equal to plain bnb).
"""

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support.bnb_optimizers import FACTORIES
from support.bnb_state import assert_equals_plain, bnb_moments, flat_bnb_state, flat_param_states
from deepspeed.utils import safe_get_full_optimizer_state, safe_get_local_optimizer_state
from deepspeed_bnb.runtime.engine import stock_deepspeed
from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.optim.fused.route import FUSED
from deepspeed_bnb.state_layout import GroupLayout
from support.toy import clone, ds_config, global_batch, loss_fn, make_model, param_groups, train_plain, train_steps

STEPS = 3
FUSED_FACTORIES = {**FACTORIES, "SGD_32bit_momentum": lambda p: bnb.optim.SGD(p, lr=1e-2, momentum=0.9,
                                                                              min_8bit_size=1000)}


# The API's names besides bnb's own state1/state2: torch's name of each of bnb's state rows (state1's rows, then
# state2's), per bnb update rule; DeepSpeed's FusedAdam/FusedLamb/FusedLion use the same ones.
TORCH_ALIASES = {"adam": "exp_avg exp_avg_sq", "lamb": "exp_avg exp_avg_sq",
                 "ademamix": "exp_avg exp_avg_slow exp_avg_sq", "lion": "exp_avg", "momentum": "momentum_buffer",
                 "lars": "momentum_buffer", "rmsprop": "square_avg", "adagrad": "sum"}


def check_state_api(model, reference, plain, rule):
    """DeepSpeed's safe_get_full/local_optimizer_state give every parameter's bnb state, dequantized, by every name."""
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        moments = bnb_moments(plain.state[q], q.numel())
        expected = {key: (rows[0] if len(rows) == 1 else rows) for key, rows in moments.items()}
        expected.update(zip(TORCH_ALIASES[rule].split(), torch.cat(list(moments.values()))))
        assert sorted(p._hp_mapping.get_optim_state_keys()) == sorted(expected), pname
        for key, value in expected.items():
            full, local = safe_get_full_optimizer_state(p, key), safe_get_local_optimizer_state(p, key)
            shape = (*value.shape[:-1], *q.shape)
            assert full.dtype == local.dtype == torch.float32, f"{pname}.{key}"
            assert full.shape == shape and torch.equal(full, value.reshape(shape)), f"{pname}.{key}"
            assert torch.equal(local, value), f"{pname}.{key}"  # DP=1: the whole parameter, flattened
        assert any(v.abs().max() > 0 for v in expected.values()), f"{pname}: the state moved"


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
    check_state_api(model, reference, plain, plain.optimizer_name)


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
    # and its state API hands out the 8-bit codes as numbers (0..255), not moments, and knows no exp_avg
    codes = safe_get_full_optimizer_state(model.fc1.weight, "state1")
    assert codes.max() > 1 and torch.equal(codes, codes.round())
    with pytest.raises(ValueError, match="exp_avg not found"):
        safe_get_full_optimizer_state(model.fc1.weight, "exp_avg")


# each rule's hyper row from a param group, written out here rather than taken from the registry's row builders
# (rules.RULES[...].row), so that this comparison holds those to bnb's own parameters too
HYPER_ROWS = {
    "adam": lambda group, t: AdamHyper.adamw(group["lr"], *group["betas"], group["eps"], group["weight_decay"], t),
    "lion": lambda group, t: LionHyper.lion(group["lr"], *group["betas"], group["weight_decay"]),
    # betas = (momentum, dampening): bnb's rule ignores the dampening; its step counter picks the step-1 rule
    "momentum": lambda group, t: MomentumHyper.momentum(group["lr"], group["betas"][0], group["weight_decay"], t),
}


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


def test_fused_unscale_factor_is_deepspeeds(one_rank, monkeypatch):
    """The unscale/clip factor handed to the fused kernel is the one DeepSpeed's own unscale_and_clip_grads multiplies
    the gradient partition by, for clipping norms, norms below the bar and invalid norms (inf, NaN, -1)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed_bnb.runtime.zero import unscale_factor
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
        factor = opt._bnb_inv_scale.pop(0)
        assert factor.dtype == torch.float32 and factor.dim() == 0
        theirs = grad.clone()
        DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, [theirs], torch.tensor(norm))
        torch.testing.assert_close(grad * factor, theirs, rtol=0, atol=0, equal_nan=True)
        factors[norm] = float(factor)
    assert factors[123.0] < 1.0 and factors[0.01] == 1.0  # control: clipping is active for the large norm only
    # gradients that are not a partition's are multiplied here, by the same factor DeepSpeed's method uses
    other, theirs = grad.clone(), grad.clone()
    opt.unscale_and_clip_grads([[other]], torch.tensor(123.0))
    DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, [[theirs]], torch.tensor(123.0))
    assert torch.equal(other, theirs) and not torch.equal(other, grad)
    # DeepSpeed calls it once per param group with the step's one norm tensor: computed once for it, and again when
    # the norm changed in place or the clip did
    computed = []
    real = unscale_factor.combined_unscale_factor
    monkeypatch.setattr(unscale_factor, "combined_unscale_factor", lambda *args: computed.append(1) or real(*args))
    partition.grad = grad.clone()
    norm = torch.tensor(123.0)
    opt.unscale_and_clip_grads([partition.grad], norm)
    first = opt._bnb_inv_scale.pop(0)
    opt.unscale_and_clip_grads([partition.grad], norm)
    assert torch.equal(opt._bnb_inv_scale.pop(0), first) and len(computed) == 1
    norm.fill_(1230.0)
    opt.unscale_and_clip_grads([partition.grad], norm)
    assert float(opt._bnb_inv_scale.pop(0)) < float(first) and len(computed) == 2
    # neither clipping nor a loss scale: nothing to fold in (the same norm tensor as before)
    opt.clip_grad = 0.0
    opt.unscale_and_clip_grads([partition.grad], norm)
    assert opt._bnb_inv_scale.pop(0) is None and torch.equal(partition.grad, grad)
    partition.grad = None


def test_invalid_norm_clipping_follows_the_release():
    """Where DeepSpeed's unscale_and_clip_grads changed (compat.py): 0.19.8 clips an invalid norm as an infinite one."""
    from deepspeed_bnb.runtime.zero.compat import clips_invalid_norm_as_inf
    assert not clips_invalid_norm_as_inf("0.19.7") and not clips_invalid_norm_as_inf("0.16.4")
    assert clips_invalid_norm_as_inf("0.19.8") and clips_invalid_norm_as_inf("0.20.0rc1")


class PerParameterReference:
    """The fused step's reference applied to each of `params` alone (its own one-segment partition), and plain bnb
    (`factory`) to the other parameters: no ZeRO."""

    def __init__(self, factory, groups, params):
        self.params = set(params)
        self.optimizer, self.state = factory(groups), {}
        self.others = factory([{**g, "params": [p for p in g["params"] if p not in self.params]} for g in groups])
        self.rule = self.optimizer.optimizer_name
        self.moments = range(rules.get(self.rule).moments)
        self.qmaps = [bnb.functional.create_dynamic_map(signed=signed) for signed in rules.SIGNED_MAPS]

    def step(self, t):
        self.others.step()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in self.params:
                    p.grad = None
                    continue
                n = p.numel()
                if p not in self.state:  # 8-bit state (the kernel steps 8-bit parameters only): codes, absmax
                    self.state[p] = ([torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)],
                                     [torch.zeros(-(-n // 256)), torch.zeros(-(-n // 256))])
                codes, absmax = self.state[p]
                table = rules.segment_table(GroupLayout((n,), 1).segments(0, [True]), [0])
                hyper = rules.hyper_table([HYPER_ROWS[self.rule](group, t)])
                rules.step_(self.rule, p.data.view(-1), p.grad.view(-1), *([row[k] for k in self.moments]
                                                                           for row in (codes, absmax)),
                            [torch.zeros(0) for _ in self.moments], [self.qmaps[k] for k in self.moments], table,
                            hyper, 1.0, use_kernel=False)
                p.grad = None


@pytest.mark.parametrize("name", ["AdamW8bit", "Adam8bit", "AdamW_32bit", "Lion8bit", "Lion_32bit",
                                  "SGD8bit_momentum", "SGD_32bit_momentum"])
def test_default_zero_dp1_is_kernel_reference_or_plain_bnb(one_rank, name):
    """Under ZeRO with the default bnb_fused_kernel ("auto"), the kernel steps every parameter: each 8-bit one as the
    fused kernel's reference steps that parameter alone, and each 32-bit-state one as plain bnb steps it, bit for bit
    (the reference model: the same split, no ZeRO); every parameter's state has plain bnb's keys, dtypes and shapes
    (checkpoints load with either path)."""
    model = make_model(0)
    copy, bnb_copy = clone(model), clone(model)
    factory = FUSED_FACTORIES[name]
    engine, *_ = deepspeed.initialize(model=model, optimizer=factory(param_groups(model)), config=ds_config(1, stage=2))
    routes, eight_bit = engine.optimizer.bnb_routes, engine.optimizer.bnb.eight_bit
    # the kernel steps every parameter here; its 8-bit ones as its reference, its 32-bit ones as bnb (bnb_cpu)
    assert all(route is FUSED for route in routes.values()), routes
    fused = [q for p, q in zip(model.parameters(), copy.parameters()) if eight_bit(p)]
    assert bool(fused) == ("32bit" not in name), "8-bit Adam, Lion and SGD-momentum parameters: fused by default"
    per_parameter = PerParameterReference(factory, param_groups(copy), fused)
    plain = factory(param_groups(bnb_copy))
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        engine.backward(loss_fn(engine, tokens, targets))
        engine.step()
        loss_fn(copy, tokens, targets).backward()
        per_parameter.step(step + 1)
    train_plain(bnb_copy, plain)
    states = flat_param_states(engine)
    for (pname, p), q, r in zip(model.named_parameters(), copy.parameters(), bnb_copy.parameters()):
        mine, theirs = states[p], flat_bnb_state(plain.state[r], r.numel())
        assert mine.keys() == theirs.keys(), pname
        assert torch.equal(p.detach(), q.detach()), f"{name}: weights of {pname} differ ({routes[pname]})"
        for key in mine:
            assert type(mine[key]) is type(theirs[key]), f"{pname}.{key}"
            if torch.is_tensor(mine[key]):
                assert (mine[key].dtype, mine[key].shape) == (theirs[key].dtype, theirs[key].shape), f"{pname}.{key}"
        if all(q is not f for f in fused):  # the same bnb update on the same weights and gradients: the same state
            expected = flat_bnb_state(per_parameter.others.state[q], q.numel())
            assert all(torch.equal(mine[k], expected[k]) if torch.is_tensor(mine[k]) else mine[k] == expected[k]
                       for k in mine), f"{name}: state of {pname}"
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
