"""Pure-torch reference of the fused 8-bit AdamW, Lion and SGD-with-momentum steps of a ZeRO partition, and of
blockwise quantization.

What it does: updates one flat fp32 partition in place, walking a segment table (one row per parameter piece:
offset, length, 8-bit or fp32 state, hyper-parameter row). This file *is* the canonical semantics the compiled
kernels (csrc/cpu, csrc/cuda) are held to bit for bit; it is slow and written for clarity.

Canonical semantics (why: bnb's backends disagree with each other: its CUDA kernels, its CPU path and its 32-bit
kernels round, skip non-finite gradients and apply weight decay differently, as noted below):
- IEEE fp32, every operation individually rounded: no FMA contraction; sqrt and division correctly rounded (computed
  in fp64 and rounded once, which is exact for them; torch's own fp32 sqrt is not correctly rounded on x86 CPUs).
- Per element, with `g = grad * inv_scale` (DeepSpeed's combined unscale/clip factor, a one-element fp32 tensor;
  skipped when None):
  AdamW (adam8bit_step, two states m and v):
      m = beta1 * m_old + (1 - beta1) * g
      v = beta2 * v_old + (1 - beta2) * (g * g)
      p = p * (1 - lr * wd) + step_size * (m / (sqrt(v) + eps_hat))
  with each bracket evaluated left to right (decoupled weight decay, as bnb's AdamW/Adam8bit), in bnb's CUDA
  arrangement: step_size = -lr * sqrt(1 - beta2^t) / (1 - beta1^t), eps_hat = eps * sqrt(1 - beta2^t).
  Lion (lion8bit_step, one state m; bnb's "lion" rule, Chen et al. 2023):
      c = beta1 * m_old + (1 - beta1) * g
      p = p * (1 - lr * wd) - lr * sign(c)
      m = beta2 * m_old + (1 - beta2) * g
  decoupled weight decay applied before the update, for 8-bit and fp32 state alike (bnb's CPU path and its 8-bit
  CUDA kernel; its 32-bit CUDA kernel adds wd * p to g instead), sign as bnb's CUDA `sgn` and torch.sign (bnb's CPU
  path): +1, -1, and +0 for a zero or NaN c (so p - lr * 0 leaves p exactly). The update direction uses the *old*
  momentum; the momentum is updated after.
  SGD with momentum (momentum8bit_step, one state m; bnb's "momentum" rule, SGD8bit / SGD with momentum > 0):
      g' = g + p * wd                          (coupled weight decay, only when wd > 0)
      m  = g'                 at step 1        (bnb's rule: the first step ignores the stored momentum)
      m  = beta1 * m_old + g' after            (no dampening: bnb takes it but never uses it; no Nesterov either)
      p  = p - lr * m                          (the *new* momentum)
  the step-1 choice comes with the hyper row (MomentumHyper.first), as it does in bnb from its step counter.
  Host constants (1 - beta, 1 - lr * wd, ...) are computed in fp64 and rounded to fp32 once.
- A non-finite `g` skips the element: its parameter (weight decay included) and state keep their values (bnb's CUDA
  Adam kernel zeroes its moments; bnb's 1-state CUDA kernel and its CPU path let inf/NaN into the state).
- 8-bit state: s_old = qmap[code] * absmax[block] (signed qmap1 for m, unsigned qmap2 for Adam's v). After the
  update each 256-element block takes absmax = max |s| over the block's elements of this segment (padding lanes
  excluded) and each element the nearest code of u = s * (1 / absmax) (one division per block, as bnb's CUDA kernel;
  then the code whose fp32 midpoints bracket u; exactly on a midpoint: the lower one; inf * 0 counts as the sign of
  s, a NaN s as 0). 0 is exactly representable (so a zero momentum stays zero, and with it the parameter of an
  element whose gradient is always zero); bnb CUDA's extra sign fix (a tiny negative value never rounds to +0) is not
  applied. A block whose absmax is 0 (or NaN) stores the code of 0.0. absmax propagates NaN like torch.amax.
  Adam's second moment has a floor: a positive v whose nearest code is 0's takes the smallest positive code of qmap2
  (one code up; 0 stays 0). Why: in a block whose absmax is far larger, nearest rounding stores a small v as 0 while
  its m, in its own block and only linear in the gradient, stays nonzero; the next step then divides m by about
  sqrt((1 - beta2) g^2) instead of the v accumulated so far (measured on a 2-layer GPT-2: a single-element update of
  4.5 x lr where bnb's own update moved no element more than 1.4 x lr). bnb's CUDA kernel rounds the same way (and
  shares the spike); bnb's CPU path never stores 0 for a positive value (its look-up rounds small values up).
- fp32 state segments keep their state in fp32 arrays packed in segment order. In the "bnb_cpu" arithmetic (BNB_CPU,
  CPU kernels only) they follow bitsandbytes' own 32-bit CPU update instead, operation by operation (ops/bnb_cpu32.py:
  its fused multiply-adds, torch's own sqrt, no element skipped for a non-finite gradient), so that the kernel's launch
  can step 32-bit-state parameters with bnb's bits; 8-bit segments are the same in both.
- Master weights (`params`): fp32; or bf16, widened exactly and the updated value rounded to nearest even (bnb's own
  update of a bf16 parameter rounds its fp32 result once, the same way); or compensated bf16 + int8 error terms
  (`error`, ops/compensated.py), joined to fp32 and split again. Every stored NaN is bf16's quiet NaN 0x7FC0.
- The sign and payload of a NaN are unspecified (x86 vector units and torch produce different ones).
- `lp_params` (optional, beside fp32 master weights only): the model's copy of the updated weights, fp32 or bf16 of
  the partition's size, written for every element of every segment (the bf16 one rounded to nearest even as torch's
  conversion rounds, NaN as 0x7FC0; the CUDA kernels write torch's CUDA conversion, whose NaN may differ in payload:
  above), so that DeepSpeed need not convert the partition in a pass of its own.
- Alignment padding (elements in no segment) is never read or written.
References: bitsandbytes 0.50.2 `backends/cpu/ops.py` (`_optimizer_update_8bit_blockwise_cpu`), `csrc/kernels.cu`
(`kOptimizerStatic8bit2StateBlockwise`, and `kOptimizerStatic8bit1StateBlockwise`'s LION and MOMENTUM branches,
`kOptimizer32bit1State`'s MOMENTUM branch), `_optimizer_update_32bit_cpu`, `optim/sgd.py`; Loshchilov & Hutter,
Decoupled Weight Decay Regularization (AdamW); Chen et al., Symbolic Discovery of Optimization Algorithms (Lion).
Build/test: pure Python, nothing to build; tests/kernels/test_fused_rules.py holds every rule's kernels to it and it to
bitsandbytes (tests/support/rule_cases.py: one case per rule); tests/kernels/test_fused_{adam,lion,momentum}.py check
what is one rule's own.
"""

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

import torch

from deepspeed_bnb.ops import bnb_cpu32, compensated
from deepspeed_bnb.state_layout import BLOCK_SIZE  # pure math: importable without DeepSpeed and bitsandbytes

IEEE = "ieee"  # the arithmetic defined above, every segment (ops/rules.py names the arithmetics)
BNB_CPU = "bnb_cpu"  # the same for 8-bit segments; fp32 segments as bnb's own 32-bit CPU update (ops/bnb_cpu32.py)
SEGMENT_FIELDS = 5  # columns of the segment table: offset, numel, eight_bit, fp32_offset, hyper_row
HYPER_FIELDS = 7  # columns of the AdamW hyper-parameter table, see AdamHyper.row()
LION_HYPER_FIELDS = 6  # columns of the Lion hyper-parameter table, see LionHyper.row()
MOMENTUM_HYPER_FIELDS = 4  # columns of the SGD-momentum hyper-parameter table, see MomentumHyper.row()


@dataclass(frozen=True)
class AdamHyper:
    """One row of the AdamW hyper-parameter table: per-step fp32 constants of one parameter group (host-computed)."""

    FIELDS: ClassVar[int] = HYPER_FIELDS
    beta1: float  # first-moment decay
    beta2: float  # second-moment decay
    one_minus_beta1: float  # 1 - beta1, fp64 then rounded
    one_minus_beta2: float  # 1 - beta2, fp64 then rounded
    eps_hat: float  # eps * sqrt(1 - beta2^t)
    decay: float  # 1 - lr * weight_decay
    step_size: float  # -lr * sqrt(1 - beta2^t) / (1 - beta1^t)

    @classmethod
    def adamw(cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int) -> "AdamHyper":
        c2 = math.sqrt(1.0 - beta2 ** step)
        return cls(beta1=beta1, beta2=beta2, one_minus_beta1=1.0 - beta1, one_minus_beta2=1.0 - beta2,
                   eps_hat=eps * c2, decay=1.0 - lr * weight_decay, step_size=-lr * c2 / (1.0 - beta1 ** step))

    def row(self) -> Tuple[float, ...]:
        return (self.beta1, self.beta2, self.one_minus_beta1, self.one_minus_beta2, self.eps_hat, self.decay,
                self.step_size)


@dataclass(frozen=True)
class LionHyper:
    """One row of the Lion hyper-parameter table (no step-dependent term: Lion has no bias correction)."""

    FIELDS: ClassVar[int] = LION_HYPER_FIELDS
    beta1: float  # interpolation of momentum and gradient for the update direction
    beta2: float  # momentum decay
    one_minus_beta1: float  # 1 - beta1, fp64 then rounded
    one_minus_beta2: float  # 1 - beta2, fp64 then rounded
    decay: float  # 1 - lr * weight_decay
    lr: float  # the step of each element: lr * sign(c)

    @classmethod
    def lion(cls, lr: float, beta1: float, beta2: float, weight_decay: float) -> "LionHyper":
        return cls(beta1=beta1, beta2=beta2, one_minus_beta1=1.0 - beta1, one_minus_beta2=1.0 - beta2,
                   decay=1.0 - lr * weight_decay, lr=lr)

    def row(self) -> Tuple[float, ...]:
        return (self.beta1, self.beta2, self.one_minus_beta1, self.one_minus_beta2, self.decay, self.lr)


@dataclass(frozen=True)
class MomentumHyper:
    """One row of the SGD-with-momentum hyper-parameter table (bnb's "momentum" rule)."""

    FIELDS: ClassVar[int] = MOMENTUM_HYPER_FIELDS
    beta1: float  # momentum (bnb's betas[0]); dampening and nesterov are not part of bnb's rule
    weight_decay: float  # coupled: g + p * weight_decay, applied only when > 0
    lr: float  # p - lr * m
    first: float  # 1.0 at step 1 (m = g, the stored momentum is ignored), else 0.0

    @classmethod
    def momentum(cls, lr: float, beta1: float, weight_decay: float, step: int) -> "MomentumHyper":
        return cls(beta1=beta1, weight_decay=weight_decay, lr=lr, first=1.0 if step == 1 else 0.0)

    def row(self) -> Tuple[float, ...]:
        return (self.beta1, self.weight_decay, self.lr, self.first)


def dynamic_map(signed: bool = True) -> torch.Tensor:
    """bitsandbytes' default 8-bit dynamic map (create_dynamic_map(signed), 7 exponent bits), rebuilt with the same fp32
    operations so its 256 values are the same bits, for machines without bitsandbytes (a GPU machine without it, unless
    a trimmed copy is carried there; tests/support/cuda_kernel_run.py). Signed (Adam's m, Lion, momentum): per decade
    10^-6..10^0 the midpoints of 2^i + 1 evenly spaced points in [0.1, 1] (i = 0..6), both signs, plus 0 and 1; unsigned
    (Adam's v): 2^(i+1) + 1 points, positive only. Sorted ascending. tests/kernels/test_fused_adam.py holds it to
    bnb's."""
    values = [0.0, 1.0]
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, (2 ** i if signed else 2 ** (i + 1)) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        if signed:
            values += (-(10 ** (i - 6)) * means).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


def quant_tables(qmap: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(fp32 midpoints between consecutive sorted map values [255], code of each sorted value [256] as int32)."""
    values, order = torch.sort(qmap.float())
    midpoints = (values[1:] + values[:-1]) / 2  # fp32: (a + b) rounded, then / 2 exact
    return midpoints.contiguous(), order.to(torch.int32).contiguous()


def _div(a: torch.Tensor, b) -> torch.Tensor:
    b = b.double() if torch.is_tensor(b) else float(torch.tensor(b, dtype=torch.float32))
    return (a.double() / b).float()


def _sqrt(a: torch.Tensor) -> torch.Tensor:
    return a.double().sqrt().float()


def positive_floor(qmap: torch.Tensor) -> Tuple[int, int]:
    """(code of 0.0, code of the smallest positive value) of a map holding both, else (-1, -1): the codes of the floor
    Adam's second moment is stored with (see the module docstring)."""
    values, order = torch.sort(qmap.float())
    for i in range(len(values) - 1):
        if values[i] == 0 and values[i + 1] > 0:
            return int(order[i]), int(order[i + 1])
    return -1, -1


def quantize_blockwise(values: torch.Tensor, qmap: torch.Tensor, block: int = BLOCK_SIZE, floor: bool = False
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 absmax per block) of a 1-D fp32 tensor: blocks start at element 0, the last may be short.
    `floor`: a positive value whose nearest code is 0's takes the smallest positive code (Adam's second moment)."""
    values = values.reshape(-1).float()
    n = values.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
    padded[:n] = values.abs()
    absmax = padded.view(blocks, block).amax(dim=1)
    reciprocal = torch.where(absmax > 0, _div(torch.ones_like(absmax), absmax), torch.zeros_like(absmax))
    normalized = values * reciprocal.repeat_interleave(block)[:n]
    sign = torch.copysign(torch.ones_like(values), values)
    fallback = torch.where(torch.isnan(values), torch.zeros_like(values), sign)
    normalized = torch.where(torch.isnan(normalized), fallback, normalized)
    midpoints, order = quant_tables(qmap.to(values.device))
    position = torch.searchsorted(midpoints, normalized, right=False)  # count of midpoints < value
    codes = order.long()[position]
    zero, smallest = positive_floor(qmap) if floor else (-1, -1)
    if zero >= 0:
        codes = torch.where((codes == zero) & (values > 0), torch.full_like(codes, smallest), codes)
    return codes.to(torch.uint8), absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor,
                         block: int = BLOCK_SIZE) -> torch.Tensor:
    n = codes.shape[-1]
    return qmap.float()[codes.long()] * absmax.repeat_interleave(block, dim=-1).narrow(-1, 0, n)


def code_gap(values: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block: int = BLOCK_SIZE
             ) -> torch.Tensor:
    """Per element: the gap between the two map entries around its normalized value, times its block's absmax."""
    values = values.reshape(-1).float()
    scale = absmax.repeat_interleave(block)[:values.numel()]
    ordered = torch.sort(qmap.float().to(values.device)).values
    normalized = torch.where(scale > 0, values / scale, torch.zeros_like(values)).clamp(ordered[0], ordered[-1])
    upper = torch.searchsorted(ordered, normalized).clamp(1, len(ordered) - 1)
    return (ordered[upper] - ordered[upper - 1]) * scale


def _moments(old_m, old_v, g, h: torch.Tensor):
    beta1, beta2, omb1, omb2 = h[0], h[1], h[2], h[3]
    m = beta1 * old_m + omb1 * g
    v = beta2 * old_v + omb2 * (g * g)
    return m, v


def _param_update(p, m, v, h: torch.Tensor):
    eps_hat, decay, step_size = h[4], h[5], h[6]
    return p * decay + step_size * _div(m, _sqrt(v) + eps_hat)


def _lion_update(p, m_old, g, h: torch.Tensor):
    """(new parameter, new momentum) of Lion; see the module docstring."""
    beta1, beta2, omb1, omb2, decay, lr = h[0], h[1], h[2], h[3], h[4], h[5]
    decayed = p * decay
    c = beta1 * m_old + omb1 * g
    sign = (c > 0).float() - (c < 0).float()  # bnb's sgn: +0 for zero and NaN (as torch.sign, spelled out)
    return decayed - lr * sign, beta2 * m_old + omb2 * g


def _momentum_update(p, m_old, g, h: torch.Tensor):
    """(new parameter, new momentum) of SGD with momentum; see the module docstring."""
    beta1, wd, lr, first = h[0], h[1], h[2], h[3]
    if wd > 0:
        g = g + p * wd
    m = g if first != 0 else beta1 * m_old + g
    return p - lr * m, m


@dataclass(frozen=True)
class _Segment:
    offset: int
    numel: int
    eight_bit: bool
    fp32_offset: int


class _State:
    """One optimizer state of one segment: its 8-bit codes and per-block absmax (dequantized on load, requantized on
    store), or its slice of the packed fp32 state."""

    def __init__(self, segment: _Segment, codes, absmax, qmap, fp32, floor: bool = False):
        self.eight_bit, self.qmap, self.floor = segment.eight_bit, qmap, floor
        if segment.eight_bit:
            first, blocks = segment.offset // BLOCK_SIZE, -(-segment.numel // BLOCK_SIZE)
            self.codes = codes.narrow(0, segment.offset, segment.numel)
            self.absmax = absmax.narrow(0, first, blocks)
        else:
            self.fp32 = fp32.narrow(0, segment.fp32_offset, segment.numel)

    def load(self) -> torch.Tensor:
        if self.eight_bit:
            return dequantize_blockwise(self.codes, self.absmax, self.qmap)
        return self.fp32.clone()

    def store(self, value: torch.Tensor) -> None:
        if self.eight_bit:
            codes, absmax = quantize_blockwise(value, self.qmap, floor=self.floor)
            self.codes.copy_(codes)
            self.absmax.copy_(absmax)
        else:
            self.fp32.copy_(value)


def _master_kind(params: torch.Tensor, error: Optional[torch.Tensor]) -> None:
    if error is None and params.dtype in (torch.float32, torch.bfloat16):
        return
    if error is not None and params.dtype == torch.bfloat16 and error.dtype == torch.int8 and \
            error.numel() == params.numel():
        return
    raise ValueError(f"params must be fp32 or bf16, and error (compensated master weights) int8 beside bf16 params "
                     f"of the same size; got params {params.dtype}"
                     + ("" if error is None else f", error {error.dtype} [{error.numel()}] for [{params.numel()}]"))


def _scale(inv_scale: Optional[torch.Tensor], arithmetic: str) -> Optional[torch.Tensor]:
    """The unscale factor as an fp32 scalar tensor on the CPU (None: none), after checking the arithmetic: the
    reference defines the IEEE one and BNB_CPU (the IEEE one with fp32 segments as bnb's own 32-bit CPU update,
    ops/bnb_cpu32.py); bnb's CUDA arithmetic uses the GPU's approximate reciprocal and square root, which no CPU
    reproduces (tests/gpu holds that one to bitsandbytes itself)."""
    if arithmetic not in (IEEE, BNB_CPU):
        raise ValueError(f"the pure-torch reference computes the {IEEE!r} and {BNB_CPU!r} arithmetics, not "
                         f"{arithmetic!r}")
    return None if inv_scale is None else inv_scale.detach().reshape(()).float().cpu()


def _model_copy(params: torch.Tensor, error: Optional[torch.Tensor], lp_params: Optional[torch.Tensor]) -> None:
    if lp_params is None:
        return
    if params.dtype != torch.float32 or error is not None:
        raise ValueError(f"lp_params (the model's copy of the updated weights) goes with float32 master weights; got "
                         f"{params.dtype} params{' with error terms' if error is not None else ''}")
    if lp_params.dtype not in (torch.float32, torch.bfloat16) or lp_params.numel() != params.numel():
        raise ValueError(f"lp_params must be float32 or bfloat16 with params' {params.numel()} elements, got "
                         f"{lp_params.dtype} [{lp_params.numel()}]")


def _walk(params, grads, segments, hyper, inv_scale, update, error=None, arithmetic: str = IEEE,
          bnb_fp32_update=None, lp_params: Optional[torch.Tensor] = None) -> None:
    """Call update(segment, p, g, finite, h) for every row of the segment table (p: the segment's fp32 master weights,
    a view of params, or for bf16 and compensated ones a widened copy stored back after; g: its scaled fp32 gradient,
    finite: isfinite(g), h: its hyper row); in the BNB_CPU arithmetic, bnb_fp32_update(segment, p, g, h) instead for
    fp32 segments, with g the gradient bnb reads (the unscale factor applied in the gradient's own dtype, as
    DeepSpeed's grad.mul_ applies it, then widened); then each segment's model copy into lp_params where given."""
    _master_kind(params, error)
    _model_copy(params, error, lp_params)
    inv_scale = _scale(inv_scale, arithmetic)
    hyper = hyper.float()
    for offset, numel, eight_bit, fp32_offset, row in segments.tolist():
        p = params.narrow(0, offset, numel)
        lo = None if error is None else error.narrow(0, offset, numel)
        wide = p if p.dtype == torch.float32 else (p.float() if lo is None else compensated.join(p, lo))
        segment = _Segment(offset, numel, bool(eight_bit), fp32_offset)
        if arithmetic == BNB_CPU and not eight_bit:
            g = grads.narrow(0, offset, numel)
            g = (g if inv_scale is None else g * inv_scale.to(g.device)).float()
            bnb_fp32_update(segment, wide, g, hyper[row])
        else:
            g = grads.narrow(0, offset, numel).float()
            if inv_scale is not None:
                g = g * inv_scale.to(g.device)
            update(segment, wide, g, torch.isfinite(g), hyper[row])
        if lo is not None:
            compensated.split_(wide, p, lo)
        elif wide is not p:
            p.copy_(compensated.to_bf16(wide))
        if lp_params is not None:
            out = lp_params.narrow(0, offset, numel)
            out.copy_(wide if out.dtype == torch.float32 else compensated.to_bf16(wide))


@torch.no_grad()
def adam8bit_step(params: torch.Tensor, grads: torch.Tensor, codes1: torch.Tensor, codes2: torch.Tensor,
                  absmax1: torch.Tensor, absmax2: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                  qmap1: torch.Tensor, qmap2: torch.Tensor, segments: torch.Tensor, hyper: torch.Tensor,
                  inv_scale: Optional[torch.Tensor], error: Optional[torch.Tensor] = None,
                  arithmetic: str = IEEE, lp_params: Optional[torch.Tensor] = None) -> None:
    """In place: one AdamW step of every segment of a flat partition (see the module docstring for semantics).

    params fp32 or bf16 [P] (master weights; error: int8 [P], their error terms when compensated); grads
    fp32/bf16/fp16 [P]; codes1/codes2 uint8 [P] and absmax1/absmax2 fp32 [P/256] (8-bit
    segments, indexed by partition offset); state1/state2 fp32 [F] (fp32 segments, by fp32 offset); qmap1/qmap2 fp32
    [256]; segments int64 [S, 5]; hyper fp32 [H, 7].
    """
    def update(segment, p, g, finite, h):
        first = _State(segment, codes1, absmax1, qmap1, state1)
        second = _State(segment, codes2, absmax2, qmap2, state2, floor=True)
        old_m, old_v = first.load(), second.load()
        m, v = _moments(old_m, old_v, g, h)
        m, v = torch.where(finite, m, old_m), torch.where(finite, v, old_v)
        p.copy_(torch.where(finite, _param_update(p, m, v, h), p))
        first.store(m)
        second.store(v)

    def bnb_fp32_update(segment, p, g, h):
        bnb_cpu32.adam(p, state1.narrow(0, segment.fp32_offset, segment.numel),
                       state2.narrow(0, segment.fp32_offset, segment.numel), g, h)
    _walk(params, grads, segments, hyper, inv_scale, update, error, arithmetic, bnb_fp32_update, lp_params)


@torch.no_grad()
def lion8bit_step(params: torch.Tensor, grads: torch.Tensor, codes1: torch.Tensor, absmax1: torch.Tensor,
                  state1: torch.Tensor, qmap1: torch.Tensor, segments: torch.Tensor, hyper: torch.Tensor,
                  inv_scale: Optional[torch.Tensor], error: Optional[torch.Tensor] = None,
                  arithmetic: str = IEEE, lp_params: Optional[torch.Tensor] = None) -> None:
    """In place: one Lion step of every segment of a flat partition (see the module docstring for semantics).

    As adam8bit_step with one state (the momentum): codes1 uint8 [P] and absmax1 fp32 [P/256] for 8-bit segments,
    state1 fp32 [F] for fp32 segments, qmap1 the signed map; hyper fp32 [H, 6] (LionHyper rows).
    """
    def update(segment, p, g, finite, h):
        momentum = _State(segment, codes1, absmax1, qmap1, state1)
        old_m = momentum.load()
        new_p, m = _lion_update(p, old_m, g, h)
        p.copy_(torch.where(finite, new_p, p))
        momentum.store(torch.where(finite, m, old_m))

    def bnb_fp32_update(segment, p, g, h):
        bnb_cpu32.lion(p, state1.narrow(0, segment.fp32_offset, segment.numel), g, h)
    _walk(params, grads, segments, hyper, inv_scale, update, error, arithmetic, bnb_fp32_update, lp_params)


@torch.no_grad()
def momentum8bit_step(params: torch.Tensor, grads: torch.Tensor, codes1: torch.Tensor, absmax1: torch.Tensor,
                      state1: torch.Tensor, qmap1: torch.Tensor, segments: torch.Tensor, hyper: torch.Tensor,
                      inv_scale: Optional[torch.Tensor], error: Optional[torch.Tensor] = None,
                      arithmetic: str = IEEE, lp_params: Optional[torch.Tensor] = None) -> None:
    """In place: one SGD-with-momentum step of every segment of a flat partition (see the module docstring).

    Arguments as lion8bit_step (one state, the momentum); hyper fp32 [H, 4] (MomentumHyper rows).
    """
    def update(segment, p, g, finite, h):
        momentum = _State(segment, codes1, absmax1, qmap1, state1)
        old_m = momentum.load()
        new_p, m = _momentum_update(p, old_m, g, h)
        p.copy_(torch.where(finite, new_p, p))
        momentum.store(torch.where(finite, m, old_m))

    def bnb_fp32_update(segment, p, g, h):
        bnb_cpu32.momentum(p, state1.narrow(0, segment.fp32_offset, segment.numel), g, h)
    _walk(params, grads, segments, hyper, inv_scale, update, error, arithmetic, bnb_fp32_update, lp_params)
