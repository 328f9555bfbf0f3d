"""A first-use check of a compiled fused kernel against its oracle, on the device it is about to run on.

Why: the ZeRO optimizer steps with the compiled kernel by default (`bnb_fused_kernel: "auto"`), on whatever CPU or GPU
the job lands on. The kernel is bit-identical to its oracle where it was tested, but a build can still go wrong
where it was not: a GPU generation or CUDA toolkit the kernels never ran on, a compiler that contracts into FMAs
despite -ffp-contract=off, a prebuilt extension without code for this GPU ("no kernel image is available"). Wrong
optimizer state is silent for weeks; so before its first real step the kernel runs a small partition that touches
every path (8-bit and fp32 segments, a block tail, an all-zero block, NaN/Inf/huge/tiny gradients, two hyper rows, an
unscale factor; fp32, bf16 or compensated master weights, whichever the run steps) and is compared with its oracle in
the arithmetic it computes there (ops/rules.py): on a CPU the pure-torch reference (the oracle the test suite holds
the CPU kernels to), on a GPU bitsandbytes' own update on that GPU (ops/bnb_update.py: the kernels promise its bits);
a kernel that raises or differs by one bit is not used. On a CPU the kernel's copy of bnb's own 32-bit CPU update
(the bnb_cpu arithmetic) is checked apart, against bnb itself: where it differs, bnb's update keeps the 32-bit state
(optim/fused/route.py: kernel_arithmetic). Every rule of the registry is checked the same way: its partition, hyper
rows and argument list follow from its moment count and its row builder.
Asked with lp_copy, the kernel also writes the model's bf16 copy of the updated weights (the operators' lp_params,
beside fp32 master weights), which must be torch's conversion of the oracle's weights in every segment element and
leave the alignment padding alone: DeepSpeed's own copy after the step is what it replaces (runtime/zero/lp_copy.py).
Cost: a few milliseconds, once per rule, device, master, arithmetic and copy per process. It uses bnb's default maps: a
custom map's own quantizer path (an unsorted map, one the compact key table refuses) is covered by the test suite
only.
"""

from typing import Callable, Dict, Optional, Tuple

import torch

from deepspeed_bnb.ops import bnb_update, compensated, master_kinds, reference, rules
from deepspeed_bnb.state_layout import GroupLayout

STEPS = 3  # steps compared: state starts at zero, so the first step alone would not dequantize anything
NUMELS = (700, 300, 520)  # three parameters: 8-bit (two blocks and a 188-element tail), fp32, 8-bit
EIGHT_BIT = [True, False, True]
HYPER_ROWS = [0, 1, 1]  # hyper row of each segment
# two param groups as bnb's get_config gives them (every rule reads what it needs: momentum's betas[1] is its unused
# dampening); the first decays, the second does not
CONFIGS = ({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
           {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0})
MASTERS = master_kinds.MODES  # the master weights a kernel steps
COPY_SENTINEL = -7.25  # the model copy's elements before the first step: still there in its padding after each step
# (rule, device, master, arithmetic, lp_copy) -> disagreement or None
_verdicts: Dict[Tuple[str, str, str, str, bool], Optional[str]] = {}


def disagreement(rule: str, device, master: str = "fp32", arithmetic: Optional[str] = None,
                 lp_copy: bool = False) -> Optional[str]:
    """Why the compiled kernel of `rule` must not be used on `device` for `master` weights in `arithmetic` (default:
    the device's, rules.arithmetic_for) (it raised, or differs from its oracle), or, with `lp_copy`, must not write the
    model's bf16 copy of fp32 ones; None where it may. Checked once per rule, device, master, arithmetic and lp_copy.
    The caller has loaded the kernels."""
    arithmetic = arithmetic or rules.arithmetic_for(device)
    key = (rule, str(torch.device(device)), master, arithmetic, lp_copy)
    if key not in _verdicts:
        _verdicts[key] = compare(rule, torch.device(device), rules.get(rule).kernel(), master, arithmetic, lp_copy)
    return _verdicts[key]


def _hyper(rule: str, step: int, arithmetic: str = rules.IEEE) -> torch.Tensor:
    return rules.get(rule).rows(CONFIGS, step, arithmetic)


def _gradients(size: int, step: int, generator: torch.Generator) -> torch.Tensor:
    grads = torch.randn(size, generator=generator) * 10.0 ** (-3 * step + 3)  # 1e0, 1e-3, 1e-6
    grads[256:512] = 0.0  # an all-zero block
    special = torch.randint(0, size, (4, 3), generator=generator)
    for row, value in zip(special, (float("nan"), float("inf"), 3e19, 1e-30)):  # 3e19: g * g overflows fp32
        grads[row] = value
    return grads


def _eight_bit(rule: str, master: str, arithmetic: str):
    """The precision of each parameter: EIGHT_BIT, but for bnb's own SGD-momentum with bf16 weights, which bnb can
    only update with 8-bit state (bitsandbytes 0.50 has no bf16 entry to its 32-bit momentum kernel)."""
    if arithmetic == rules.BNB_CUDA and rule == "momentum" and master == "bf16":
        return [True] * len(EIGHT_BIT)
    return EIGHT_BIT


def _partition(rule: str, device: torch.device, master: str = "fp32", arithmetic: str = rules.IEEE) -> dict:
    """Zero state and random parameters of one partition: the tensors of the operator's signature by name (codes1,
    absmax1, state1, qmap1 and so on for each moment; `error` for compensated master weights)."""
    if master not in MASTERS:
        raise ValueError(f"master: one of {MASTERS}, got {master!r}")
    eight_bit = _eight_bit(rule, master, arithmetic)
    layout = GroupLayout(NUMELS, 1)
    size, fp32 = layout.partition_size, layout.fp32_numel(0, eight_bit)
    params = torch.randn(size, generator=torch.Generator().manual_seed(0))
    tensors = {"params": params, "segments": rules.segment_table(layout.segments(0, eight_bit), HYPER_ROWS)}
    if master == "bf16":
        tensors["params"] = params.to(torch.bfloat16)
    elif master == "bf16+8":
        tensors["params"], tensors["error"] = compensated.split(params)
    for k, signed in zip(range(1, rules.get(rule).moments + 1), rules.SIGNED_MAPS):
        # the code of 0.0: 127 in bnb's signed map, 0 in the unsigned one
        tensors.update({f"codes{k}": torch.full((size,), 127 if signed else 0, dtype=torch.uint8),
                        f"absmax{k}": torch.zeros(size // 256), f"state{k}": torch.zeros(fp32),
                        f"qmap{k}": reference.dynamic_map(signed)})
    return {name: t.to(device) for name, t in tensors.items()}


def _arguments(rule: str, t: dict, grads: torch.Tensor, hyper: torch.Tensor, inv_scale: float,
               arithmetic: str = rules.IEEE) -> tuple:
    moments = range(1, rules.get(rule).moments + 1)
    return rules.arguments(rule, t["params"], grads, *([t[f"{kind}{k}"] for k in moments]
                                                        for kind in ("codes", "absmax", "state", "qmap")),
                           t["segments"], hyper, inv_scale, t.get("error"), arithmetic, t.get("lp_params"))


def _expected_copy(params: torch.Tensor, segments: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The model's bf16 copy DeepSpeed's step would leave on `device`: torch's conversion of the updated `params` in
    every segment element, COPY_SENTINEL in the alignment padding (which the kernel never writes)."""
    converted = params.to(device).to(torch.bfloat16)
    expected = torch.full_like(converted, COPY_SENTINEL)
    for offset, numel in segments[:, :2].tolist():
        expected[offset:offset + numel] = converted[offset:offset + numel]
    return expected


def bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as their bit patterns, to compare exactly (-0.0 differs from 0.0); every NaN counts as the same NaN (its
    sign and payload are unspecified: x86 vector units and torch produce different ones). Other dtypes unchanged."""
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.element_size() == 2 else t


def compare(rule: str, device: torch.device, kernel: Callable, master: str = "fp32",
            arithmetic: Optional[str] = None, lp_copy: bool = False) -> Optional[str]:
    """Run `kernel` on `device` and the oracle of `rule` in `arithmetic` (default: the one the kernel computes on
    `device`) for STEPS steps of one small partition of `master` weights; describe the first difference (or the
    kernel's exception), or return None when every tensor agrees bit for bit after every step. The ieee oracle, the
    pure-torch reference, runs on the CPU; the bnb_cuda one, bitsandbytes' own update, on `device` (on a GPU, bnb's
    CUDA kernels), from the gradients the engine would hand it (bf16 ones for bf16 and compensated weights); the
    bnb_cpu one, bitsandbytes' own 32-bit CPU update for the fp32 segments (from CONFIGS' unrounded values, as
    update_step hands them) and the reference for the 8-bit ones (bnb_update.cpu32_oracle). `lp_copy`: the kernel also
    writes the model's bf16 copy of the fp32 `master` weights, held to _expected_copy of the oracle's."""
    arithmetic = arithmetic or rules.arithmetic_for(device)
    bnb = arithmetic == rules.BNB_CUDA
    oracle_device = device if bnb else torch.device("cpu")
    oracle_name = "the reference" if arithmetic == rules.IEEE else "bitsandbytes' own update"
    ours = _partition(rule, device, master, arithmetic)
    theirs = _partition(rule, oracle_device, master, arithmetic)
    if lp_copy:
        if master != "fp32":
            raise ValueError(f"lp_copy: the model's copy goes with fp32 master weights, got master={master!r}")
        ours["lp_params"] = torch.full_like(ours["params"], COPY_SENTINEL, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        grads, hyper = _gradients(ours["params"].numel(), step, generator), _hyper(rule, step, arithmetic)
        if bnb and master != "fp32":
            grads = grads.to(torch.bfloat16)
        inv_scale = 1.0 if step < STEPS else 1 / 3.7
        try:
            kernel(*_arguments(rule, ours, grads.to(device), hyper.to(device), inv_scale, arithmetic))
        except Exception as exc:  # e.g. no code for this GPU in the build: the reference can still run
            return f"it raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        oracle = (bnb_update.cpu32_oracle(rules.get(rule), CONFIGS, step) if arithmetic == rules.BNB_CPU else
                  rules.get(rule).oracle(arithmetic))
        try:
            oracle(*_arguments(rule, theirs, grads.to(oracle_device), hyper.to(oracle_device), inv_scale, arithmetic))
        except Exception as exc:  # bnb's own CPU update missing or broken here: nothing to hold the kernel to
            if arithmetic != rules.BNB_CPU:
                raise
            return f"{oracle_name} raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        # what the kernel's tensors must hold now (the oracle writes no copy: torch converts its weights)
        wanted = {**theirs, "lp_params": _expected_copy(theirs["params"], ours["segments"].cpu(), device)} \
            if lp_copy else theirs
        for name in ours:
            mine, expected = bits(ours[name].cpu()), bits(wanted[name].cpu())
            if not torch.equal(mine, expected):
                where = (mine != expected).nonzero().flatten()
                first = int(where[0])
                against = "torch's conversion of " + oracle_name + "'s weights" if name == "lp_params" else oracle_name
                return (f"after step {step}, {name} differs from {against} at {where.numel()} of "
                        f"{mine.numel()} elements (first at {first}: {ours[name].cpu().flatten()[first].item()!r} vs "
                        f"{wanted[name].cpu().flatten()[first].item()!r})")
    return None
