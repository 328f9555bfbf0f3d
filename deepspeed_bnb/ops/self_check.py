"""A first-use check of a compiled fused kernel against its pure-torch reference, on the device it is about to run on.

Why: the ZeRO optimizer steps with the compiled kernel by default (`bnb_fused_kernel: "auto"`), on whatever CPU or GPU
the job lands on. The kernel is bit-identical to the reference where it was tested, but a build can still go wrong
where it was not: a GPU generation or CUDA toolkit the kernels never ran on, a compiler that contracts into FMAs
despite -ffp-contract=off, a prebuilt extension without code for this GPU ("no kernel image is available"). Wrong
optimizer state is silent for weeks; so before its first real step the kernel runs a small partition that touches
every path (8-bit and fp32 segments, a block tail, an all-zero block, NaN/Inf/huge/tiny gradients, two hyper rows, an
unscale factor, the bf16 copy) and is compared with the reference run on the CPU (the oracle the test suite holds
the CPU kernels to); a kernel that raises or differs by one bit is not used.
Cost: a few milliseconds, once per rule and device per process. It uses bnb's default maps: a custom map's own
quantizer path (an unsorted map, one the compact key table refuses) is covered by the test suite only.
"""

from typing import Callable, Dict, Optional, Tuple

import torch

from deepspeed_bnb.ops import adam8bit, reference
from deepspeed_bnb.ops.reference import AdamHyper, LionHyper, MomentumHyper
from deepspeed_bnb.state_layout import GroupLayout

STEPS = 3  # steps compared: state starts at zero, so the first step alone would not dequantize anything
NUMELS = (700, 300, 520)  # three parameters: 8-bit (two blocks and a 188-element tail), fp32, 8-bit
EIGHT_BIT = [True, False, True]
HYPER_ROWS = [0, 1, 1]  # hyper row of each segment

REFERENCES: Dict[str, Callable] = {"adam": reference.adam8bit_step, "lion": reference.lion8bit_step,
                                    "momentum": reference.momentum8bit_step}  # the oracle of each rule
_OPERATORS = {"adam": "adam8bit_step_", "lion": "lion8bit_step_", "momentum": "momentum8bit_step_"}
RULES = tuple(_OPERATORS)  # bnb update rules with a compiled kernel
_verdicts: Dict[Tuple[str, str], Optional[str]] = {}  # (rule, device) -> disagreement or None


def compiled(rule: str) -> Callable:
    """The compiled operator of a bnb update rule ("adam", "lion" or "momentum"); the caller has loaded it."""
    return getattr(torch.ops.deepspeed_bnb, _OPERATORS[rule])


def disagreement(rule: str, device) -> Optional[str]:
    """Why the compiled kernel of `rule` must not be used on `device` (it raised, or differs from the reference), or
    None; checked once per rule and device."""
    key = (rule, str(torch.device(device)))
    if key not in _verdicts:
        _verdicts[key] = compare(rule, torch.device(device), compiled(rule))
    return _verdicts[key]


def _hyper(rule: str, step: int) -> torch.Tensor:
    if rule == "lion":
        rows = [LionHyper.lion(1e-4, 0.9, 0.99, 0.01), LionHyper.lion(3e-3, 0.8, 0.95, 0.0)]
    elif rule == "momentum":
        rows = [MomentumHyper.momentum(1e-2, 0.9, 0.01, step), MomentumHyper.momentum(3e-2, 0.5, 0.0, step)]
    else:
        rows = [AdamHyper.adamw(1e-3, 0.9, 0.999, 1e-8, 0.01, step), AdamHyper.adamw(3e-2, 0.8, 0.95, 1e-6, 0.0, step)]
    return adam8bit.hyper_table(rows)


def _gradients(size: int, step: int, generator: torch.Generator) -> torch.Tensor:
    grads = torch.randn(size, generator=generator) * 10.0 ** (-3 * step + 3)  # 1e0, 1e-3, 1e-6
    grads[256:512] = 0.0  # an all-zero block
    special = torch.randint(0, size, (4, 3), generator=generator)
    for row, value in zip(special, (float("nan"), float("inf"), 3e19, 1e-30)):  # 3e19: g * g overflows fp32
        grads[row] = value
    return grads


def _partition(rule: str, device: torch.device) -> dict:
    """Zero state and random parameters of one partition, the tensors of the operator's signature by name."""
    layout = GroupLayout(NUMELS, 1)
    segments = layout.segments(0, EIGHT_BIT)
    size, fp32 = layout.partition_size, layout.fp32_numel(0, EIGHT_BIT)
    tensors = {"params": torch.randn(size, generator=torch.Generator().manual_seed(0)),
               "codes1": torch.full((size,), 127, dtype=torch.uint8), "absmax1": torch.zeros(size // 256),
               "state1": torch.zeros(fp32), "qmap1": reference.dynamic_map(True),
               "segments": adam8bit.segment_table(segments, HYPER_ROWS), "lp": torch.zeros(size, dtype=torch.bfloat16)}
    if rule == "adam":
        tensors.update(codes2=torch.zeros(size, dtype=torch.uint8), absmax2=torch.zeros(size // 256),
                       state2=torch.zeros(fp32), qmap2=reference.dynamic_map(False))
    return {name: t.to(device) for name, t in tensors.items()}


def _arguments(rule: str, t: dict, grads: torch.Tensor, hyper: torch.Tensor, inv_scale: float) -> tuple:
    if rule == "adam":
        return (t["params"], grads, t["codes1"], t["codes2"], t["absmax1"], t["absmax2"], t["state1"], t["state2"],
                t["qmap1"], t["qmap2"], t["segments"], hyper, inv_scale, t["lp"])
    return (t["params"], grads, t["codes1"], t["absmax1"], t["state1"], t["qmap1"], t["segments"], hyper, inv_scale,
            t["lp"])


def bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as their bit patterns, to compare exactly (-0.0 differs from 0.0); every NaN counts as the same NaN (its
    sign and payload are unspecified: x86 vector units and torch produce different ones). Other dtypes unchanged."""
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.element_size() == 2 else t


def compare(rule: str, device: torch.device, kernel: Callable) -> Optional[str]:
    """Run `kernel` on `device` and the reference of `rule` on the CPU (the oracle the CPU kernels are held to, bit
    for bit, by the tests) for STEPS steps of one small partition; describe the first difference (or the kernel's
    exception), or return None when every tensor agrees bit for bit after every step."""
    ours = _partition(rule, device)
    theirs = _partition(rule, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        grads, hyper = _gradients(ours["params"].numel(), step, generator), _hyper(rule, step)
        inv_scale = 1.0 if step < STEPS else 1 / 3.7
        try:
            kernel(*_arguments(rule, ours, grads.to(device), hyper.to(device), inv_scale))
        except Exception as exc:  # e.g. no code for this GPU in the build: the reference can still run
            return f"it raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        REFERENCES[rule](*_arguments(rule, theirs, grads, hyper, inv_scale))
        for name in ours:
            mine, expected = bits(ours[name].cpu()), bits(theirs[name])
            if not torch.equal(mine, expected):
                where = (mine != expected).nonzero().flatten()
                first = int(where[0])
                return (f"after step {step}, {name} differs from the reference at {where.numel()} of "
                        f"{mine.numel()} elements (first at {first}: {ours[name].cpu().flatten()[first].item()!r} vs "
                        f"{theirs[name].flatten()[first].item()!r})")
    return None
