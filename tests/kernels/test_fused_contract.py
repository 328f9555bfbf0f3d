"""The default path steps every parameter exactly as the user's bitsandbytes optimizer would, or within the fused
kernel's documented relation to it where the contract (optim/fused/contract.py) lets the kernel step.

For every bitsandbytes optimizer class, and for each field of bnb's get_config set to a non-neutral value (plus
per-parameter overrides), a partition of two param groups (8-bit and fp32-state parameters side by side) is stepped
by the default path (PartitionStep with the kernel available) and, independently, by plain bitsandbytes on the same
parameters and gradients:
- every parameter the contract routes to bnb's own update, and every 32-bit-state parameter (which the kernel steps
  in bnb's own 32-bit CPU arithmetic where the contract lets it), ends bit for bit equal to plain bnb (weights and
  state) after several steps; with the default settings of an optimizer whose rule has a kernel, the kernel steps
  every parameter;
- every parameter the kernel steps is held, at each step, to bnb's own update from the same state (the
  `bnb_fused_kernel: false` path run on a copy): codes within one quantization step, weights within a small
  fraction of the step.
Controls: a contract that fuses everything does not match plain bnb in the cases the contract routes to bnb; the
per-step relation check catches a kernel run with a wrong learning rate.
"""

import copy
import types
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import bitsandbytes as bnb
import pytest
import torch
from bitsandbytes.optim.optimizer import GlobalOptimManager, Optimizer8bit

from support.bnb_state import flat_bnb_state, same_state
from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
from deepspeed_bnb.ops import rule_fields, rules
from deepspeed_bnb.optim.fused import contract, partition_step, route as fused_route
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.fused.partition import FusedPartition
from deepspeed_bnb.optim.fused.route import FUSED, Route
from deepspeed_bnb.optim.fused.partition_step import PartitionStep
from deepspeed_bnb.state_layout import GroupLayout
from support.fused_relation import fp32_one_minus, relation_breaks
from support.kernel_harness import needs_kernel

GROUPS = ((3000, 700), (1500, 300))  # per param group: with min_8bit_size=1000, one 8-bit and one fp32 parameter
STEPS = 3
CLASSES = sorted((cls for cls in (getattr(bnb.optim, name) for name in dir(bnb.optim))
                  if isinstance(cls, type) and issubclass(cls, Optimizer8bit)), key=lambda cls: cls.__name__)
NEEDS_MOMENTUM = ("SGD", "LARS")


def construct(cls, params):
    extra = {"momentum": 0.9} if cls.__name__.startswith(NEEDS_MOMENTUM) else {}
    return cls(params, lr=1e-3, min_8bit_size=1000, **extra)


@dataclass(frozen=True)
class Variant:
    """One non-neutral setting of a get_config field, applied the way a user would set it."""

    name: str
    apply: Callable  # (optimizer, params) -> None; before the first step


def _group(key, value_of, name=None):
    def apply(optimizer, params):
        for group in optimizer.param_groups:
            group[key] = value_of(group.get(key))
    return _named(name or key, apply)


def _arg(key, value_of):
    def apply(optimizer, params):
        setattr(optimizer.args, key, value_of(getattr(optimizer.args, key)))
        if key == "optim_bits" and getattr(optimizer.args, key) == 8 and "dynamic" not in optimizer.name2qmap:
            optimizer.fill_qmap()
    return _named(key, apply)


def _override(name, key, value):
    def apply(optimizer, params):  # GlobalOptimManager, as HF Trainer registers its 32-bit embedding override
        GlobalOptimManager.get_instance().override_config(params[2], key, value)
    return _named(name, apply)


def _named(name, apply):
    return Variant(name, apply)


VARIANTS = [
    _named("defaults", lambda optimizer, params: None),
    _group("betas", lambda betas: tuple(b * 0.9 for b in betas)),
    _group("betas", lambda betas: tuple(betas) + (0.999,), name="betas+1"),  # a third beta where bnb reads one
    _group("eps", lambda eps: 1e-3),
    _group("weight_decay", lambda wd: 0.2),
    _group("lr", lambda lr: 5e-3),
    _group("alpha", lambda alpha: 2.0),
    _group("t_alpha", lambda t: 5),
    _group("t_beta3", lambda t: 5),
    _arg("optim_bits", lambda bits: 40 - bits),  # 8 <-> 32
    _arg("min_8bit_size", lambda size: 0),  # every parameter 8-bit
    _arg("max_unorm", lambda unorm: 0.0 if unorm else 1e-3),
    _arg("skip_zeros", lambda skip: not skip),
    _override("override lr", "lr", 3e-3),
    _override("override optim_bits", "optim_bits", 32),
    _override("override unknown key", "my_scale", 2.0),
]


def gradients(step: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(n, generator=g) for numels in GROUPS for n in numels]
    grads[0][512:1024] = 0.0  # whole zero blocks (bnb's CPU path moves them; the kernel keeps them)
    grads[2][:100] = 0.0
    return grads


def initial_params() -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g) * 0.1) for numels in GROUPS for n in numels]


def split(flat_list):
    it = iter(flat_list)
    return [[next(it) for _ in numels] for numels in GROUPS]


class Partitions:
    """Each param group flattened block-aligned (DP=1), as BnbZeroOptimizer holds it, stepped by PartitionStep."""

    def __init__(self, optimizer, params, kernel: Route):
        self.optimizer, self.params = optimizer, params
        self.adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), 256)
        self.layouts = [GroupLayout(numels, 1) for numels in GROUPS]
        self.eight_bit = [[self.adapter.eight_bit(p) for p in group] for group in split(params)]
        self.flat, self.states, self.steps = [], [], []
        for i, (group_params, layout) in enumerate(zip(split(params), self.layouts)):
            flat = torch.zeros(layout.total_numel)
            for slot, p in zip(layout.slots, group_params):
                flat.narrow(0, slot.offset, slot.numel).copy_(p.detach())
            segments = layout.segments(0, self.eight_bit[i])
            group = optimizer.param_groups[i]
            self.flat.append(flat)
            self.states.append(self.adapter.allocate(group, i, segments, layout.partition_size, self.eight_bit[i],
                                                     "cpu"))
            self.steps.append(self.stepper(i, kernel))

    def stepper(self, i, kernel: Route) -> PartitionStep:
        segments = self.layouts[i].segments(0, self.eight_bit[i])
        return PartitionStep(self.adapter, i, segments, [self.adapter.override(p) for p in split(self.params)[i]],
                             self.eight_bit[i], "cpu", kernel)

    def step(self, grads, steps=None, states=None, flat=None):
        for i, layout in enumerate(self.layouts):
            flat_grad = torch.zeros(layout.total_numel)
            for slot, grad in zip(layout.slots, split(grads)[i]):
                flat_grad.narrow(0, slot.offset, slot.numel).copy_(grad)
            (steps or self.steps)[i].step(self.optimizer.param_groups[i], (flat or self.flat)[i], flat_grad,
                                          (states or self.states)[i])

    def routes(self) -> List[Route]:
        return [route for step in self.steps for route in step.param_routes]

    def weights(self, flat=None) -> List[torch.Tensor]:
        return [(flat or self.flat)[i].narrow(0, slot.offset, slot.numel).clone()
                for i, layout in enumerate(self.layouts) for slot in layout.slots]

    def param_states(self, states=None) -> List[dict]:
        out = []
        for i, layout in enumerate(self.layouts):
            state = (states or self.states)[i]
            out += gather_param_states(layout, self.eight_bit[i], self.adapter.stored_classes(state), [state])
        return out


def test_cuda_hyperparameter_rounding_widens_the_absmax_bar_by_that_rounding_alone():
    """bnb's CUDA second moments are (1 - fp32 beta2) / (1 - beta2) = 1 - 1.29e-5 of the exact ones (measured on an
    H200: fused / bnb absmax2 = 1.0000128 to 1.0000131 over 92 blocks). The bar takes that in on CUDA, and no more.
    Controls: the same difference breaks the CPU bar, and twice it breaks the CUDA bar."""
    assert fp32_one_minus(0.999) == pytest.approx(1.2874e-5, rel=1e-3)
    assert fp32_one_minus(0.9) < 3e-7
    codes = torch.zeros(256, dtype=torch.uint8)
    qmap = torch.linspace(-1, 1, 256)
    weights = torch.ones(4), torch.ones(4), torch.zeros(4)  # mine, bnb's, before: both took the same step
    bnbs = {"state1": codes, "absmax1": torch.ones(1), "qmap1": qmap,
            "state2": codes, "absmax2": torch.ones(1), "qmap2": qmap}

    def breaks(factor, cuda_betas):
        mine = {**bnbs, "absmax2": bnbs["absmax2"] * (1 + factor * fp32_one_minus(0.999))}
        return relation_breaks(mine, bnbs, *weights, cuda_betas=cuda_betas)

    assert breaks(1.0, (0.9, 0.999)) == []
    assert any("absmax2" in b for b in breaks(1.0, None))
    assert any("absmax2" in b for b in breaks(2.0, (0.9, 0.999)))


class BnbRefuses(Exception):
    """Plain bnb raised at a step, and the default path raised the same kind of error at that step."""


@dataclass
class Outcome:
    """The default path and plain bnb after STEPS steps, and what the per-step relation check found."""

    routes: List[Route]  # per parameter (DP=1: one segment each)
    eight_bit: List[bool]  # per parameter
    weights: List[torch.Tensor]  # the default path's
    states: List[dict]  # the default path's, per parameter, bnb-shaped
    plain_weights: List[torch.Tensor]  # plain bnb's
    plain_states: List[dict]  # plain bnb's
    checked: int = 0  # fused parameter-steps held to bnb's own step
    breaks: List[str] = field(default_factory=list)  # relation breaks found

    def bnb_routed_mismatches(self, where: str) -> List[str]:
        """Parameters that must equal plain bnb in every bit, whose weights or state differ: those the contract gives
        bnb's update, and those with 32-bit state (the kernel steps them in bnb's own 32-bit CPU arithmetic)."""
        out = []
        for j, (route, eight_bit) in enumerate(zip(self.routes, self.eight_bit)):
            if route is FUSED and eight_bit:
                continue
            if not torch.equal(self.weights[j], self.plain_weights[j]):
                out.append(f"{where}, parameter {j} ({route}): weights")
            elif not same_state(self.states[j], self.plain_states[j]):
                out.append(f"{where}, parameter {j} ({route}): state")
        return out


def run(cls, variant: Variant) -> Outcome:
    """The default path (kernel where the contract allows) and plain bnb side by side, same parameters and
    gradients; at every step the default path's fused parameters are compared with bnb's own step (the
    `bnb_fused_kernel: false` path) from the same state."""
    params, plain_params = initial_params(), initial_params()
    optimizer = construct(cls, [{"params": g, "lr": 1e-3 * (i + 1)} for i, g in enumerate(split(params))])
    plain = construct(cls, [{"params": g, "lr": 1e-3 * (i + 1)} for i, g in enumerate(split(plain_params))])
    manager = GlobalOptimManager.get_instance()
    try:
        variant.apply(optimizer, params)
        variant.apply(plain, plain_params)
        ours = Partitions(optimizer, params, FUSED)
        teacher = [ours.stepper(i, Route("zero_optimization.bnb_fused_kernel is false")) for i in range(len(GROUPS))]
        checked, breaks = 0, []
        for step in range(STEPS):
            grads = gradients(step)
            before_states, before_flat = copy.deepcopy(ours.states), [f.clone() for f in ours.flat]
            w_before = ours.weights()
            for p, g in zip(plain_params, grads):
                p.grad = g.clone()
            try:
                plain.step()
            except Exception as exc:  # noqa: BLE001  (whatever bnb raises, the default path must raise it too)
                with pytest.raises(type(exc)):
                    ours.step(grads)
                raise BnbRefuses(f"{type(exc).__name__}: {exc}") from exc
            ours.step(grads)
            ours.step(grads, steps=teacher, states=before_states, flat=before_flat)  # bnb's step, same start
            mine, bnbs = ours.param_states(), ours.param_states(before_states)
            for j, (route, w_mine, w_bnb) in enumerate(zip(ours.routes(), ours.weights(), ours.weights(before_flat))):
                if route is FUSED:
                    checked += 1
                    breaks += [f"parameter {j}, step {step + 1}: {b}"
                               for b in relation_breaks(mine[j], bnbs[j], w_mine, w_bnb, w_before[j])]
        return Outcome(routes=ours.routes(), eight_bit=[e for group in ours.eight_bit for e in group],
                       weights=ours.weights(), states=ours.param_states(),
                       plain_weights=[q.detach() for q in plain_params],
                       plain_states=[flat_bnb_state(plain.state[q], q.numel()) for q in plain_params],
                       checked=checked, breaks=breaks)
    finally:
        for p in params + plain_params:
            manager.pid2config.pop(id(p), None)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_default_path_is_bnbs_update(cls, variant):
    try:
        outcome = run(cls, variant)
    except BnbRefuses:  # a setting bnb itself rejects stays rejected: the default path is not more lenient
        return
    where = f"{cls.__name__}, {variant.name}"
    assert not outcome.bnb_routed_mismatches(where), outcome.bnb_routed_mismatches(where)
    assert not outcome.breaks, f"{where}: {outcome.breaks}"
    if variant.name == "defaults" and construct(cls, initial_params()).optimizer_name in rules.RULES:
        assert all(route is FUSED for route in outcome.routes), "the kernel steps every parameter by default"
        assert outcome.checked > 0, "the kernel's steps were held to bnb's own"


def _routes(cls, name):
    return run(cls, next(v for v in VARIANTS if v.name == name)).routes


@needs_kernel
def test_contract_routes_what_the_kernel_does_not_model():
    """Spot checks of the routes the matrix above relies on (8-bit parameters are #0 and #2)."""
    assert _routes(bnb.optim.AdamW8bit, "defaults")[0] is FUSED
    assert _routes(bnb.optim.AdamW8bit, "lr")[0] is FUSED
    assert "skip_zeros=True" in _routes(bnb.optim.AdamW8bit, "skip_zeros")[0].reason
    assert "betas" in _routes(bnb.optim.AdamW8bit, "betas+1")[0].reason
    assert _routes(bnb.optim.Lion8bit, "betas+1")[0] is FUSED  # Optimizer1State reads two betas only
    assert "alpha=2.0" in _routes(bnb.optim.AdamW8bit, "alpha")[0].reason
    assert _routes(bnb.optim.AdamW8bit, "max_unorm")[0] is FUSED  # bnb's 8-bit update ignores it
    overridden = _routes(bnb.optim.AdamW8bit, "override unknown key")
    assert overridden[0] is FUSED and "'my_scale'" in overridden[2].reason
    assert _routes(bnb.optim.AdamW8bit, "override optim_bits")[2] is FUSED  # 32-bit state, bnb's 32-bit arithmetic
    assert "max_unorm" in _routes(bnb.optim.AdamW, "max_unorm")[0].reason  # a trust ratio over 32-bit state
    assert "no fused kernel" in _routes(bnb.optim.RMSprop8bit, "defaults")[0].reason


def test_fields_are_the_ones_bnb_reads():
    """The contract enumerates exactly the fields the installed bnb's get_config returns, for every class."""
    for cls in CLASSES:
        optimizer = construct(cls, initial_params())
        assert set(optimizer.get_config(0, 0, optimizer.param_groups[0])) == set(rule_fields.FIELDS), cls


class CalledUpdate(bnb.optim.AdamW8bit):
    calls = 0

    def update_step(self, group, p, gindex, pindex):
        CalledUpdate.calls += 1
        return super().update_step(group, p, gindex, pindex)


@needs_kernel
def test_overridden_update_step_is_always_called():
    CalledUpdate.calls = 0
    outcome = run(CalledUpdate, VARIANTS[0])
    assert all("overrides bnb's update_step" in route.reason for route in outcome.routes)
    assert not outcome.bnb_routed_mismatches("CalledUpdate")
    assert CalledUpdate.calls == 3 * STEPS * len(outcome.routes)  # ours, the teacher's and plain bnb's


@needs_kernel
@pytest.mark.parametrize("cls, name", [(bnb.optim.AdamW8bit, "skip_zeros"), (bnb.optim.AdamW8bit, "alpha"),
                                       (bnb.optim.AdamW, "max_unorm"), (CalledUpdate, "defaults")], ids=str)
def test_control_fusing_everything_differs_from_bnb(cls, name, monkeypatch):
    """Without the contract (every parameter fused, a trust ratio on 32-bit state and an overridden update_step
    included), parameters the contract gives bnb's update no longer equal plain bnb: the exact comparison above is
    not vacuous."""
    routed = [j for j, route in enumerate(_routes(cls, name)) if route is not FUSED]
    monkeypatch.setattr(fused_route, "param_reason", lambda rule, config, eight_bit: None)
    monkeypatch.setattr(fused_route, "optimizer_reason", lambda optimizer: None)
    outcome = run(cls, next(v for v in VARIANTS if v.name == name))
    assert routed and all(route is FUSED for route in outcome.routes)
    outcome.routes = [Route("the real contract's") if j in routed else FUSED for j in range(len(outcome.weights))]
    assert outcome.bnb_routed_mismatches(name)


@needs_kernel
def test_control_relation_check_catches_a_wrong_kernel(monkeypatch):
    """A kernel fed a learning rate 10% off fails the per-step comparison with bnb's own step; the right one passes."""
    assert not run(bnb.optim.AdamW8bit, VARIANTS[0]).breaks
    real = partition_step.PartitionStep.step

    def wrong_lr(self, group, *args, **kwargs):
        if self.kernel.fused:  # the default path, not the teacher
            group = {**group, "lr": group["lr"] * 1.1}
        return real(self, group, *args, **kwargs)

    monkeypatch.setattr(partition_step.PartitionStep, "step", wrong_lr)
    outcome = run(bnb.optim.AdamW8bit, VARIANTS[0])
    assert any("weights off" in b for b in outcome.breaks), outcome.breaks


def _config_family():
    """bnb's config of an AdamW8bit parameter, and that config with one field changed, for each field: the values a
    schedule, a user or a subclass may set, including ones the kernel does not model."""
    optimizer = construct(bnb.optim.AdamW8bit, initial_params())
    base = optimizer.get_config(0, 0, optimizer.param_groups[0])
    values = {"lr": [1e-3, 0.5, 3, float("nan"), float("inf"), -float("inf")],
              "betas": [(0.9, 0.999), [0.9, 0.999], (0.9, 0.999, 0.5), (1.0, 0.999), (0.8, 0.99)],
              "eps": [1e-8, 1e-3], "weight_decay": [0.0, 0.1, -0.1, float("nan")], "alpha": [0.0, 2.0],
              "t_alpha": [None, 10], "t_beta3": [None, 10], "optim_bits": [8, 32], "min_8bit_size": [1000, 0],
              "max_unorm": [0.0, 0.5], "skip_zeros": [False, True], "my_scale": [1.5]}
    return [base] + [{**base, field: value} for field, choices in values.items() for value in choices]


def test_route_key_equal_keys_give_equal_routes():
    """contract.route_key is what the per-step re-check compares (partition_step.py): wherever two configs have the
    same key, every reason (each rule, 8-bit and 32-bit state) is the same; learning rates that are all finite share
    one key (a schedule is not re-checked); non-finite ones do not."""
    configs = _config_family()
    keys = [contract.route_key(c) for c in configs]
    assert None not in keys
    reasons = [[(contract.param_reason(rule, c, eight_bit), contract.fp32_param_reason(rule, c))
                for rule in rules.RULES for eight_bit in (True, False)] for c in configs]
    pairs = [(i, j) for i in range(len(configs)) for j in range(i) if keys[i] == keys[j]]
    assert all(reasons[i] == reasons[j] for i, j in pairs)
    lr_keys = {contract.route_key({**configs[0], "lr": lr}) for lr in (1e-3, 0.5, 7e-4)}
    assert len(lr_keys) == 1 and contract.route_key({**configs[0], "lr": float("nan")}) not in lr_keys
    # control: the family does hold configs whose reasons differ, so the check above is not vacuous
    assert len({repr(r) for r in reasons}) > 5


def test_route_key_sees_a_change_in_place_or_refuses():
    """A list in the config (bnb's get_config hands the group's own betas) changed in place after the key was taken
    gives another key; a value that could change in place unseen (a tensor) gives no key at all (decide again)."""
    config = {**_config_family()[0], "betas": [0.9, 0.999]}
    before = contract.route_key(config)
    config["betas"][0] = 1.0  # in place: the same list object
    assert contract.route_key(config) != before
    restored = {**config, "betas": (0.9, 0.999)}
    assert contract.param_reason("adam", config, True) != contract.param_reason("adam", restored, True)
    assert contract.route_key({**config, "lr": torch.tensor(1e-3)}) is None
    assert contract.route_key({**config, "betas": (torch.tensor(0.9), 0.999)}) is None


def test_route_key_assumes_lr_is_checked_for_finiteness_only():
    """route_key reduces lr to whether it is a finite float: true as long as every rule checks lr with
    rule_fields.finite; a rule that checks more must change route_key first."""
    assert all(rule.fields["lr"] is rule_fields.finite for rule in rules.RULES.values())


def test_hyper_table_rounds_each_value_once_from_double():
    """The hyper table holds each row's fp64 value rounded once to fp32 (the kernels' constants): equal, bit for bit,
    to a float64 table converted to float32, over random configs of every rule and steps up to 10^6."""
    g = torch.Generator().manual_seed(0)
    cpu_table = types.SimpleNamespace(_hyper_values=None, _hyper=None)
    for rule in rules.RULES.values():
        for _ in range(200):
            lr, wd, b1, b2, eps = (torch.rand(5, generator=g, dtype=torch.float64) ** 4).tolist()
            step = int(torch.randint(1, 10 ** 6, (1,), generator=g))
            config = {"lr": lr, "betas": (b1 * 0.999, b2 * 0.9999), "eps": eps * 1e-6, "weight_decay": wd}
            rows = [rule.row(config, step), rule.row({**config, "lr": lr * 3}, step + 1)]
            expected = torch.tensor([r.row() for r in rows], dtype=torch.float64).float()
            assert torch.equal(rules.hyper_table(rows).view(torch.int32), expected.view(torch.int32))
            # the CPU partition's reused table (FusedPartition._cpu_hyper: array('f') storage) rounds alike
            assert torch.equal(FusedPartition._cpu_hyper(cpu_table, rows).view(torch.int32),
                               expected.view(torch.int32))


def test_reused_cpu_hyper_table_rounds_as_torch_does():
    """FusedPartition's CPU table (one array('f') storage rewritten every step, viewed by one tensor) holds what
    rules.hyper_table's fresh tensor holds, bit for bit, at the hard cases of the double -> float32 rounding: ties
    (to even), subnormals, values past the largest float, signed zeros; and its view shows each step's rows (the
    control: a view of values written before no longer equals the new table)."""
    ties = [1 + 2 ** -24, 1 + 3 * 2 ** -24, -(1 + 2 ** -24), 2 ** -149 * 1.5, 2 ** -149 * 0.5, 2 ** -150 * 1.000001,
            3.4028235677973366e38, 3.4028235677973362e38, -0.0, 0.0, 1e-45, 1e39]

    class Row:  # any hyper row: row() gives its values
        def __init__(self, values):
            self.values = values

        def row(self):
            return tuple(self.values)
    table = types.SimpleNamespace(_hyper_values=None, _hyper=None)
    first = FusedPartition._cpu_hyper(table, [Row(ties[:6]), Row(ties[6:])])
    expected = torch.tensor([ties[:6], ties[6:]], dtype=torch.float32)
    assert torch.equal(first.view(torch.int32), expected.view(torch.int32))
    snapshot = first.clone()
    second = FusedPartition._cpu_hyper(table, [Row(ties[6:]), Row(ties[:6])])
    assert second is first  # the same storage and view, rewritten
    assert torch.equal(second.view(torch.int32), torch.tensor([ties[6:], ties[:6]], dtype=torch.float32).view(
        torch.int32))
    assert not torch.equal(snapshot, second)
