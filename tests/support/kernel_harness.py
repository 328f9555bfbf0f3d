"""The fused-kernel tests' harness: a rule's flat partition, stepped by its compiled kernel or its reference.

What it serves: tests/kernels/test_fused_rules.py holds every rule of deepspeed_bnb/ops/rules.RULES (its own pieces:
tests/support/rule_cases.py) to the same bars: the kernel bit-identical to the pure-torch reference on random partitions
(`Partition`), and the reference against bitsandbytes' own 8-bit optimizer and an exact fp64 update (`run_both`);
the per-rule test files use it for their own checks. Importable without DeepSpeed, and with only
bitsandbytes.functional.create_dynamic_map (tests/support/cuda_kernel_run.py's stand-in): bnb's optimizers are looked up
when a run against bnb starts.
"""

import itertools
from typing import Callable, Optional, Sequence

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops import compensated, loader, rules
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.state_layout import GroupLayout

QMAPS = tuple(bnb.functional.create_dynamic_map(signed=signed) for signed in rules.SIGNED_MAPS)  # bnb's, per moment
QMAP1 = QMAPS[0]
SHUFFLE = torch.randperm(256, generator=torch.Generator().manual_seed(5))  # an unsorted map: QMAPS[k][SHUFFLE]
KINDS = ("codes", "absmax", "state")  # what a step updates besides the parameters, one tensor per moment each
UNUSED = slice(1, None, 3)  # of each 64-element row: rows whose gradient is always zero in run_both(unused_rows=True)
KERNEL = loader.load()
needs_kernel = pytest.mark.skipif(not KERNEL, reason="the C++ kernel could not be built here (see the warning)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
# three bnb param groups per rule (get_config dicts) for the bnb_cuda kernels against bnb's own CUDA update
# (tests/kernels/test_fused_bnb_cuda.py); the first decays, the third too, the second does not
BNB_CUDA_CONFIGS = {
    "adam": ({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
             {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0},
             {"lr": 1e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}),
    "lion": ({"lr": 1e-4, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1},
             {"lr": 3e-3, "betas": (0.95, 0.98), "eps": 1e-8, "weight_decay": 0.0},
             {"lr": 1e-3, "betas": (0.5, 0.9), "eps": 1e-8, "weight_decay": 1.0}),
    "momentum": ({"lr": 1e-2, "betas": (0.9, 0.0), "eps": 1e-8, "weight_decay": 1e-4},
                 {"lr": 3e-2, "betas": (0.8, 0.0), "eps": 1e-8, "weight_decay": 0.0},
                 {"lr": 1e-3, "betas": (0.99, 0.0), "eps": 1e-8, "weight_decay": 0.5}),
}


def maps(rule: str, shuffled: bool = False) -> list:
    """The rule's quantization map of each moment: bnb's, or the same values in a shuffled order (the portable path:
    codes are then not sorted positions)."""
    return [(q[SHUFFLE] if shuffled else q).contiguous() for q in QMAPS[:rules.get(rule).moments]]


class Partition:
    """A random partition of RULE: several parameters (8-bit and fp32 segments, tails that are not a multiple of 256)
    of rank 1 of 3, three hyper rows (subclasses give `hyper`), state from zero, or random_start: random codes, block
    scales and fp32 state (non-negative for a moment with an unsigned map). shuffled: unsorted maps; corrupt: state
    already NaN/Inf (as bnb's path lets NaN in). master: "bf16" (bf16 params) or "bf16+8" (bf16 params and their int8
    error terms, `error`, split from the same random fp32 weights), else fp32 params."""

    RULE = ""
    error = None  # int8 error terms of compensated master weights

    def __init__(self, seed: int, device="cpu", dp=3, rank=1, grad_dtype=torch.float32, shuffled=False, corrupt=False,
                 random_start=False, master=None):
        g = torch.Generator().manual_seed(seed)
        count = int(torch.randint(2, 7, (1,), generator=g))
        numels = tuple(int(n) for n in torch.randint(1, 5000, (count,), generator=g))
        eight_bit = [bool(b) for b in torch.rand(count, generator=g) < 0.7]
        layout = GroupLayout(numels, dp)
        rank = min(rank, dp - 1)
        self.segments = layout.segments(rank, eight_bit)
        self.rows = [int(r) for r in torch.randint(0, 3, (len(self.segments),), generator=g)]
        self.params = torch.randn(layout.partition_size, generator=g).to(device)
        if master == "bf16":
            self.params = self.params.to(torch.bfloat16)
        elif master == "bf16+8":
            self.params, self.error = compensated.split(self.params)
        elif master is not None:
            raise ValueError(f"master: 'bf16', 'bf16+8' or None, got {master!r}")
        self.generator, self.device, self.grad_dtype = g, device, grad_dtype
        self.table = rules.segment_table(self.segments, self.rows).to(device)
        self._zero_state(layout.partition_size, layout.fp32_numel(rank, eight_bit), maps(self.RULE, shuffled))
        for kind, k in itertools.product(KINDS, self.moments) if random_start else ():
            shape = getattr(self, f"{kind}{k}").shape
            value = (torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) if kind == "codes" else
                     torch.rand(shape, generator=g) * 1e-2 if kind == "absmax" else
                     torch.randn(shape, generator=g) * 1e-3)
            unsigned = kind == "state" and not rules.SIGNED_MAPS[k - 1]
            setattr(self, f"{kind}{k}", (value.abs() if unsigned else value).to(device))
        for k in self.moments if corrupt else ():
            absmax, state = getattr(self, f"absmax{k}"), getattr(self, f"state{k}")
            absmax[1::5], absmax[3::7] = float("nan"), float("inf")
            state[::97], state[5::89] = float("nan"), float("-inf")

    def _zero_state(self, size: int, fp32: int, qmaps: Sequence[torch.Tensor]):
        """Codes of 0.0 (127 in bnb's signed map, 0 in the unsigned one), block scales 0, fp32 state 0."""
        self.qmaps = [q.to(self.device) for q in qmaps]
        for k, signed in zip(self.moments, rules.SIGNED_MAPS):
            setattr(self, f"codes{k}", torch.full((size,), 127 if signed else 0, dtype=torch.uint8, device=self.device))
            setattr(self, f"absmax{k}", torch.zeros(size // 256, device=self.device))
            setattr(self, f"state{k}", torch.zeros(fp32, device=self.device))

    @property
    def moments(self) -> range:
        return range(1, rules.get(self.RULE).moments + 1)

    @property
    def names(self) -> tuple:
        """What a step updates, in the operator's order."""
        error = ("error",) if self.error is not None else ()
        return ("params", *error, *(f"{kind}{k}" for kind, k in itertools.product(KINDS, self.moments)))

    def hyper(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def grads(self, step: int) -> torch.Tensor:
        g = self.generator
        grads = torch.randn(self.params.numel(), generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g))
        grads[:300] = 0.0  # an all-zero block (and a zero stretch)
        if step % 2:
            grads[torch.randint(0, grads.numel(), (5,), generator=g)] = float("nan")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = float("inf")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = float("-inf")
            # signalling NaNs (x86 and CUDA arithmetic makes only quiet ones, but a gradient's bits may come from
            # anywhere): the kernels' finite test must skip them too
            grads.view(torch.int32)[torch.randint(0, grads.numel(), (2,), generator=g)] = 0x7FA00000
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 3e19  # g * g overflows fp32
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 1e-30
        return grads.to(self.grad_dtype).to(self.device)

    def tensors(self) -> tuple:
        return tuple(getattr(self, name) for name in self.names)

    def clone(self) -> "Partition":
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        for name in self.names:
            setattr(other, name, getattr(self, name).clone())
        return other

    def step(self, step: int, grads: torch.Tensor, use_kernel: bool, inv_scale: float = 1.0, lp_params=None):
        state = ([getattr(self, f"{kind}{k}") for k in self.moments] for kind in KINDS)
        rules.step_(self.RULE, self.params, grads, *state, self.qmaps, self.table, self.hyper(step), inv_scale,
                    use_kernel=use_kernel, error=self.error, lp_params=lp_params)


class Whole(Partition):
    """One 8-bit parameter as a partition of its own (`params`, a multiple of 256 elements, stepped in place), from
    zero state, under one hyper row per step: row(step)."""

    def __init__(self, rule: str, params: torch.Tensor, row: Callable, qmaps: Optional[Sequence] = None):
        self.RULE, self.row, self.params, self.device = rule, row, params, params.device
        self.segments = GroupLayout((params.numel(),), 1).segments(0, [True])
        self.table = rules.segment_table(self.segments, [0]).to(self.device)
        self._zero_state(params.numel(), 0, maps(rule) if qmaps is None else qmaps)

    def hyper(self, step: int) -> torch.Tensor:
        return rules.hyper_table([self.row(step)]).to(self.device)


def assert_bit_identical(a: Partition, b: Partition, context: str):
    for name, x, y in zip(a.names, a.tensors(), b.tensors()):
        x, y = bits(x.cpu()), bits(y.cpu())
        if not torch.equal(x, y):
            where = (x != y).nonzero().flatten()[:5].tolist()
            raise AssertionError(f"{context}: {name} differs at {where} (of {int((x != y).sum())}): "
                                 f"{[x[i].item() for i in where]} vs {[y[i].item() for i in where]}")


def run_both(case, n=8192, steps=20, unused_rows=False, seed=0, **bnb_extra):
    """`steps` steps of one n-element parameter by bnb's 8-bit optimizer of case's rule (its CPU path) and by the
    reference, from the same start and gradients; the reference's hyper rows are the registry's, built from bnb's own
    get_config. unused_rows: no weight decay, and some rows' gradient always zero (like embedding rows of tokens never
    seen, sharing blocks with used rows). Returns the reference's Whole partition, bnb's (params, state1, absmax1),
    the exact fp64 parameters and the start."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) * case.grad_scale for _ in range(steps)]
    for grad in grads if unused_rows else ():
        grad.view(-1, 64)[UNUSED] = 0.0
    param = torch.nn.Parameter(start.clone())
    plain = case.bnb([param], weight_decay=0.0 if unused_rows else 0.01, min_8bit_size=0, **bnb_extra)
    config = plain.get_config(0, 0, plain.param_groups[0])
    ours = Whole(case.name, start.clone(), lambda t: rules.get(case.name).row(config, t))
    for t, grad in enumerate(grads, start=1):
        param.grad = grad.clone()
        plain.step()
        ours.step(t, grad, False)
    theirs = (param.detach(), plain.state[param]["state1"], plain.state[param]["absmax1"])
    return ours, theirs, case.exact(start, grads, config), start


def step_four_elements(rule: str, row, use_kernel: bool) -> tuple:
    """One step of a one-moment rule under hyper row `row` on four fp32-state elements, in exact binary fractions:
    p = [1, -2, 4, 8], m = [1, 0, -1, 3], g = [-1.5, 0, 1, NaN]; the new (p, m) as lists. The alignment padding after
    them is never touched."""
    layout = GroupLayout((4,), 1)
    params = torch.full((layout.partition_size,), 7.0)
    params[:4] = torch.tensor([1.0, -2.0, 4.0, 8.0])
    momentum = torch.tensor([1.0, 0.0, -1.0, 3.0])
    grads = torch.zeros(layout.partition_size)
    grads[:4] = torch.tensor([-1.5, 0.0, 1.0, float("nan")])
    table = rules.segment_table(layout.segments(0, [False]), [0])
    rules.step_(rule, params, grads, [torch.zeros(0, dtype=torch.uint8)], [torch.zeros(0)], [momentum], [QMAP1], table,
                rules.hyper_table([row]), 1.0, use_kernel=use_kernel)
    assert (params[4:] == 7.0).all(), "alignment padding is never touched"
    return params[:4].tolist(), momentum.tolist()
