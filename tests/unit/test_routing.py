"""deepspeed.initialize gives a bitsandbytes optimizer deepspeed_bnb's ZeRO optimizer, which steps each parameter with
bnb's own arithmetic: the fused kernel only where the contract allows it, and bnb's own update whenever the kernel
cannot run (no build, a failed first-use check), never the pure-torch reference.

Each case runs through deepspeed.initialize on one CPU rank (tests/support/toy.py) and compares with plain bitsandbytes
on a copy of the model, or with `bnb_fused_kernel: false` (itself held to plain bnb by
tests/kernels/test_matches_bnb.py).
"""

import logging
import re

import bitsandbytes as bnb
import deepspeed
import pytest
import torch
from bitsandbytes.optim.optimizer import Optimizer2State

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.ops import loader, self_check
from deepspeed_bnb.optim.fused import partition_step, route as fused_route
from deepspeed_bnb.optim.fused.route import FUSED
import deepspeed.runtime.engine as ds_engine
from deepspeed_bnb import installer
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer
from support.toy import ds_config, global_batch, loss_fn, make_model, param_groups, train_steps

STEPS = 3


def trained(factory, **zero):
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=factory(param_groups(model)),
                                      config=ds_config(1, stage=2, **zero))
    train_steps(engine, range(STEPS))
    return model, engine


def plain_bnb(factory):
    model = make_model(0)
    optimizer = factory(param_groups(model))
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        loss_fn(model, tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def max_difference(a, b) -> float:
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _trust_ratio_adam(params):  # bnb's generic 2-state optimizer, 32-bit state, with a trust ratio
    return Optimizer2State("adam", params, lr=1e-3, max_unorm=1e-3)


class CountingAdamW8bit(bnb.optim.AdamW8bit):
    """A subclass with its own update_step, as users write them (here: count, then bnb's update)."""

    calls = 0

    def update_step(self, group, p, gindex, pindex):
        CountingAdamW8bit.calls += 1
        return super().update_step(group, p, gindex, pindex)


def _counting(params):
    return CountingAdamW8bit(params, lr=1e-3, min_8bit_size=1000)


@pytest.mark.parametrize("factory", [_trust_ratio_adam, _counting], ids=["max_unorm_32bit", "update_step_override"])
def test_default_equals_plain_bnb_where_the_kernel_does_not_model_the_optimizer(one_rank, factory):
    """A 32-bit Optimizer2State with max_unorm, and a subclass overriding update_step: the default path is bnb's own
    update (weights equal to plain bnb and to `false`, bit for bit; the override is called as often)."""
    CountingAdamW8bit.calls = 0
    default, engine = trained(factory)
    default_calls, CountingAdamW8bit.calls = CountingAdamW8bit.calls, 0
    unfused, _ = trained(factory, bnb_fused_kernel=False)
    assert CountingAdamW8bit.calls == default_calls
    assert max_difference(default, unfused) == 0.0
    assert max_difference(default, plain_bnb(factory)) == 0.0
    assert all(route is not FUSED for route in engine.optimizer.bnb_routes.values())
    assert max_difference(default, make_model(0)) > 0, "control: the weights moved"
    if factory is _counting:
        assert default_calls > 0


@pytest.mark.parametrize("factory", [_trust_ratio_adam, _counting], ids=["max_unorm_32bit", "update_step_override"])
def test_control_without_the_contract_the_default_differs(one_rank, factory, monkeypatch):
    """What the contract prevents: fusing every parameter regardless changes the result (and skips the override)."""
    monkeypatch.setattr(fused_route, "optimizer_reason", lambda optimizer: None)
    monkeypatch.setattr(fused_route, "param_reason", lambda rule, config, eight_bit: None)
    monkeypatch.setattr(fused_route, "kernel_route", lambda setting, optimizer, device, master="fp32": FUSED)
    CountingAdamW8bit.calls = 0
    forced, _ = trained(factory)
    if factory is _counting:
        assert CountingAdamW8bit.calls == 0, "the kernel steps every parameter: the override is never called"
        CountingAdamW8bit.calls = 0
    assert max_difference(forced, plain_bnb(factory)) > 1e-4


def test_routes_are_logged_once_with_names_and_reasons(one_rank, caplog):
    """The 32-bit-state parameters go to bnb's own update where a trust ratio (max_unorm) scales their update, which
    the kernel does not compute; by default the kernel steps them too (bnb's own 32-bit CPU arithmetic)."""
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="DeepSpeed"):
            _, engine = trained(lambda p: Optimizer2State("adam", p, lr=1e-3, optim_bits=8, min_8bit_size=1000,
                                                          max_unorm=1.0))
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "the fused kernel steps" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "Optimizer2State: the fused kernel steps 4 parameter(s)" in lines[0]
    assert "bnb's own update steps 5 (" in lines[0] and "fc1.bias" in lines[0] and "max_unorm" in lines[0]
    assert engine.optimizer.bnb_update_summary() == ("fused kernel (C++) for 4 of 9 parameters, bnb's own update "
                                                     "for the rest")
    _, engine = trained(lambda p: bnb.optim.AdamW8bit(p, lr=1e-3, min_8bit_size=1000))
    assert engine.optimizer.bnb_update_summary() == "fused kernel (C++)"


def test_a_config_change_reroutes_at_the_next_step(one_rank):
    """The contract is checked at every step: a group switched to skip_zeros mid-run goes to bnb's update."""
    model = make_model(0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model),
                                                                                  min_8bit_size=1000),
                                      config=ds_config(1, stage=2))
    train_steps(engine, range(1))
    assert engine.optimizer.bnb_routes["fc1.weight"] is FUSED
    engine.optimizer.optimizer.args.skip_zeros = True
    train_steps(engine, range(1, 2))
    assert "skip_zeros=True" in engine.optimizer.bnb_routes["fc1.weight"].reason
    assert all(step.fused is None for step in engine.optimizer.bnb_steps)


def test_each_step_rechecks_each_distinct_config_once_not_each_parameter(one_rank, monkeypatch):
    """A config change the routes depend on (here eps, in every group) is re-checked at the next step once per
    distinct (config variant, precision) pair of a partition, whatever its number of parameters (a per-parameter check
    would ask the contract once for each of the partition's parameters: more calls, which the count rules out)."""
    _, engine = trained(_adamw8bit)
    steps = engine.optimizer.bnb_steps
    calls = []
    real = fused_route.route
    monkeypatch.setattr(fused_route, "route", lambda *args, **kwargs: calls.append(args[3]) or real(*args, **kwargs))
    for group in engine.optimizer.optimizer.param_groups:
        group["eps"] = 2e-8
    train_steps(engine, range(STEPS, STEPS + 1))
    distinct = sum(len(set(zip(step.variant, step.eight_bit))) for step in steps)
    assert len(calls) == distinct < sum(len(step.eight_bit) for step in steps)
    assert all(step.fused is not None for step in steps)  # and the routes it keeps still step the partitions


def test_a_learning_rate_schedule_is_not_rechecked_but_a_non_finite_lr_is(one_rank, monkeypatch):
    """What a route depends on in lr is whether it is a finite number (contract.route_key): a schedule that changes
    lr every step asks the contract nothing, and the kernel steps with each new lr: the weights equal those of the
    same run re-checked at every step (no key), which differ from a run without the schedule (the control that the
    comparison sees lr). And an lr that turns NaN is re-checked at once and goes to bnb's update."""
    schedule = [1e-3, 7e-4, 3e-4]

    def run(lrs, keyed=True):
        if not keyed:
            monkeypatch.setattr(partition_step, "route_key", lambda config: None)
        model = make_model(0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw8bit(param_groups(model)),
                                          config=ds_config(1, stage=2))
        train_steps(engine, range(1))
        calls = []
        real = fused_route.route
        monkeypatch.setattr(fused_route, "route", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
        for step, lr in enumerate(lrs, start=1):
            for group in engine.optimizer.optimizer.param_groups:
                group["lr"] = lr
            train_steps(engine, range(step, step + 1))
        monkeypatch.undo()
        return model, engine, calls

    model, engine, calls = run(schedule)
    assert calls == [] and all(step.fused is not None for step in engine.optimizer.bnb_steps)
    rechecked, _, every_step = run(schedule, keyed=False)
    assert len(every_step) >= len(schedule) and max_difference(model, rechecked) == 0.0
    constant, _, _ = run([schedule[0]] * len(schedule))
    assert max_difference(model, constant) > 0.0

    recheck = []
    real = fused_route.route
    monkeypatch.setattr(fused_route, "route", lambda *a, **k: recheck.append(a[3]) or real(*a, **k))
    partition, group = engine.optimizer.bnb_steps[0], engine.optimizer.optimizer.param_groups[0]
    group["lr"] = float("nan")
    partition.route(group)
    assert recheck and not any(route.fused for route in partition.param_routes)
    assert "lr=nan is not a finite number" in partition.param_routes[0].reason


def _adamw8bit(params):
    return bnb.optim.AdamW8bit(params, lr=1e-3, min_8bit_size=1000)


@pytest.mark.parametrize("failure", ["no build", "failed first-use check"])
def test_kernel_that_cannot_run_falls_back_to_bnb_with_one_warning(one_rank, monkeypatch, failure):
    """No build (compiler missing, or a prebuilt one for another CPU that JIT could not replace) or a failed first-use
    check: one warning, then bnb's own update, equal to `false` bit for bit; `true` refuses instead."""
    if failure == "no build":
        monkeypatch.setattr(loader, "load", lambda: False)
        monkeypatch.setitem(loader._state, "error", "RuntimeError: no compiler (planted)")
        says = re.escape("could not be built or loaded here (RuntimeError: no compiler (planted))")
    else:
        monkeypatch.setattr(self_check, "disagreement", lambda rule, device, master="fp32": "codes1 differs (planted)")
        says = "'adam' kernel failed its first-use check on cpu .*codes1 differs \\(planted\\)"
    with pytest.warns(RuntimeWarning, match=says) as warned:
        fallback, engine = trained(_adamw8bit)
    assert len([w for w in warned if "deepspeed_bnb" in str(w.message)]) == 1
    assert "bitsandbytes' own update steps this run" in str(warned[0].message)
    assert all(route is not FUSED for route in engine.optimizer.bnb_routes.values())
    unfused, _ = trained(_adamw8bit, bnb_fused_kernel=False)
    assert max_difference(fallback, unfused) == 0.0
    with pytest.raises(ValueError, match="bnb_fused_kernel: true, but .*" + says):
        trained(_adamw8bit, bnb_fused_kernel=True)


def test_control_a_kernel_that_runs_is_used(one_rank):
    """The same optimizer with a working kernel: the kernel steps the 8-bit parameters, and the result differs from
    bnb's own update (so the equality above is the fallback's doing)."""
    fused, engine = trained(_adamw8bit)
    assert any(route is FUSED for route in engine.optimizer.bnb_routes.values())
    unfused, _ = trained(_adamw8bit, bnb_fused_kernel=False)
    assert max_difference(fused, unfused) > 0.0


def test_gpu_default_is_the_kernel_once_its_first_use_check_holds(one_rank, monkeypatch):
    """On a GPU `auto` is the fused kernel when its first-use check against bnb's own CUDA update holds there; when
    the check fails, bnb's own update steps the run after a warning naming it, and `true` refuses. Control: a device
    without kernels is refused whatever the check says."""
    _, engine = trained(_adamw8bit)
    optimizer = engine.optimizer
    monkeypatch.setattr(self_check, "disagreement",
                        lambda rule, device, master="fp32": None if device.type == "cuda" else "x")
    assert fused_route.kernel_route("auto", optimizer.optimizer, torch.device("cuda")) is FUSED
    assert fused_route.kernel_route(True, optimizer.optimizer, torch.device("cuda")) is FUSED
    monkeypatch.setattr(self_check, "disagreement",
                        lambda rule, device, master="fp32": "it raised RuntimeError: no kernel image")
    with pytest.warns(RuntimeWarning, match="first-use check on cuda.*no kernel image.*own update steps this run"):
        reason = fused_route.kernel_route("auto", optimizer.optimizer, torch.device("cuda")).reason
    assert "first-use check on cuda" in reason
    with pytest.raises(ValueError, match="first-use check on cuda.*no kernel image"):
        fused_route.kernel_route(True, optimizer.optimizer, torch.device("cuda"))
    monkeypatch.setattr(self_check, "disagreement", lambda rule, device, master="fp32": None)
    assert "not on xpu" in fused_route.kernel_route("auto", optimizer.optimizer, torch.device("xpu")).reason


def test_gpu_plan_steps_32bit_state_in_the_kernel_too(one_rank):
    """On a GPU the kernel computes bnb's own CUDA arithmetic, its 32-bit kernels included: every parameter of the
    toy (8-bit and 32-bit state) routes to the kernel there, so one launch steps a whole partition. Control: in the
    ieee arithmetic the 32-bit ones stay with bnb's own update (its CPU path is torch operations that arithmetic does
    not reproduce; the bnb_cpu one does: tests/kernels/test_step_launches.py)."""
    from deepspeed_bnb.ops import rules
    _, engine = trained(_adamw8bit)
    optimizer = engine.optimizer

    def routes(step, arithmetic):
        decided = fused_route.route_decisions(optimizer.optimizer, FUSED, step._configs, step._keys, None, arithmetic)
        return [decided[key] for key in zip(step.variant, step.eight_bit)]

    for step in optimizer.bnb_steps:
        gpu, cpu = routes(step, rules.BNB_CUDA), routes(step, rules.IEEE)
        assert all(route is FUSED for route in gpu)
        assert [route is FUSED for route in cpu] == list(step.eight_bit)
    assert not all(all(step.eight_bit) for step in optimizer.bnb_steps)  # the toy has 32-bit state to route


def test_bnb_optimizer_is_always_stepped_by_bnb_zero_optimizer(one_rank, monkeypatch):
    """Routing cannot fail silently: should DeepSpeed build its ZeRO optimizer by another route than the one
    deepspeed_bnb hooks (here: the stock class, whatever the module-level name says), initialize raises, naming the
    DeepSpeed version and what changed. Control: the normal route gives BnbZeroOptimizer."""
    _, engine = trained(_adamw8bit)
    assert isinstance(engine.optimizer, BnbZeroOptimizer)
    stock = installer.stock("DeepSpeedEngine._configure_zero_optimizer")
    stock_class = ds_engine.DeepSpeedZeroOptimizer  # outside the call, the name is DeepSpeed's own

    def another_route(self, optimizer):  # what a DeepSpeed that resolves the class elsewhere would do
        ours, ds_engine.DeepSpeedZeroOptimizer = ds_engine.DeepSpeedZeroOptimizer, stock_class
        try:
            return stock(self, optimizer)
        finally:
            ds_engine.DeepSpeedZeroOptimizer = ours

    monkeypatch.setitem(installer._STOCK, "DeepSpeedEngine._configure_zero_optimizer", another_route)
    with pytest.raises(RuntimeError, match=rf"DeepSpeed {deepspeed.__version__} built "
                                           r"deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer .*AdamW8bit"):
        trained(_adamw8bit)


def test_non_bnb_optimizer_is_a_type_error():
    with pytest.raises(TypeError, match="got torch.optim.adamw.AdamW"):
        BnbZeroOptimizer(torch.optim.AdamW(make_model(0).parameters()), {})


class StepOverride(bnb.optim.AdamW8bit):
    def step(self, closure=None):  # noqa: D102  (never called under ZeRO: the point of the test)
        return super().step(closure)


def test_step_override_is_refused(one_rank):
    """bnb's step() is never called under ZeRO (the package steps segments with update_step): a class that overrides
    it is refused by name rather than silently skipped."""
    model = make_model(0)
    with pytest.raises(TypeError, match=r"StepOverride overrides step\(\) \(test_routing.StepOverride.step\)"):
        deepspeed.initialize(model=model, optimizer=StepOverride(param_groups(model)), config=ds_config(1, stage=2))
