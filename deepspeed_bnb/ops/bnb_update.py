"""bitsandbytes' own update of a flat ZeRO partition, with the fused operators' argument layout: the oracle of the
"bnb_cuda" arithmetic, and the rows that arithmetic's kernels read.

The bnb_cuda kernels (csrc/include/dsbnb/bnb_cuda_math.h) promise the bits of bnb's own CUDA kernels. No CPU can
compute those (they rest on the GPU's approximate reciprocal, square root and powers), so their oracle is bnb itself:
`step_` walks the same segment table and hyper rows as the operator and calls bnb's functional update on every
segment, exactly as bnb's `update_step` would for that parameter piece (optim/bnb_adapter.py does the same through
the optimizer): 8-bit segments through `optimizer_update_8bit_blockwise` on their codes and absmax, 32-bit ones through
`optimizer_update_32bit` on their packed fp32 state, pieces of at most MAX_UPDATE_NUMEL elements, the
unscale factor applied to a copy of the gradient as DeepSpeed's mul_ applies it, compensated master weights widened to
fp32 and split back. The first-use check (ops/self_check.py) and the GPU proof hold the kernels to it.

bitsandbytes' CUDA update counts elements in 32 bits: `optimizer_update_8bit_blockwise` and `optimizer_update_32bit`
(0.49 and 0.50) pass `ctypes.c_int32(g.numel())`, so a tensor of 2^31 elements or more reaches the kernel with a
negative count ("invalid configuration argument", or part of the tensor left unstepped), and its kernels round counts up
to whole thread blocks in `int`. A ZeRO partition of one huge parameter (an embedding of 2^31 elements, a partition at
DP 1) is such a tensor, so bnb's update is called on block-aligned pieces of at most MAX_UPDATE_NUMEL elements (here and
in optim/bnb_adapter.py): its 8-bit update is block-wise and its 32-bit update element-wise, so the pieces' updates are
the update of the whole, except a per-tensor trust ratio (max_unorm > 0 with 32-bit state), which is refused for such a
parameter.
BnbHyper is one row of the bnb_cuda hyper table: bnb's kernel arguments for one param group (every rule alike; a rule
ignores what it does not read), rounded to fp32 as bnb's ctypes.c_float arguments are.
"""

from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Tuple

import torch

from deepspeed_bnb.ops import compensated, reference
from deepspeed_bnb.state_layout import BLOCK_SIZE, Segment, split_segment

MAX_UPDATE_NUMEL = 1 << 30  # elements per call of bnb's update: every int bnb's CUDA kernels derive stays < 2^31
BNB_HYPER_FIELDS = 7  # columns of a bnb_cuda hyper row (csrc/include/dsbnb/adam8bit.h: BnbRow)


@dataclass(frozen=True)
class BnbHyper:
    """One row of the bnb_cuda hyper table: what bnb's update_step hands its kernels for one param group."""

    FIELDS: ClassVar[int] = BNB_HYPER_FIELDS
    beta1: float  # betas[0]
    beta2: float  # betas[1] (SGD-momentum: the dampening, unread)
    eps: float  # eps (read by Adam only)
    weight_decay: float  # weight_decay
    lr: float  # lr
    step: float  # bnb's step counter (counted from 1), as the fp32 its kernels convert it to
    gnorm_scale: float  # 1.0: bnb's update_step always passes it

    @classmethod
    def of(cls, config: dict, step: int) -> "BnbHyper":
        """The row of one bnb get_config dict at bnb's step `step`."""
        return cls(beta1=config["betas"][0], beta2=config["betas"][1], eps=config["eps"],
                   weight_decay=config["weight_decay"], lr=config["lr"], step=float(step), gnorm_scale=1.0)

    def row(self) -> Tuple[float, ...]:
        return (self.beta1, self.beta2, self.eps, self.weight_decay, self.lr, self.step, self.gnorm_scale)


def _segments(table: torch.Tensor):
    for offset, numel, eight_bit, fp32_offset, row in table.tolist():
        yield Segment(slot=0, param_start=0, numel=numel, offset=offset, eight_bit=bool(eight_bit),
                      fp32_offset=fp32_offset if not eight_bit else -1), row


@torch.no_grad()
def step_(rule: str, params: torch.Tensor, grads: torch.Tensor, codes: Sequence[torch.Tensor],
          absmax: Sequence[torch.Tensor], state: Sequence[torch.Tensor], qmaps: Sequence[torch.Tensor],
          segments: torch.Tensor, hyper, inv_scale: Optional[torch.Tensor] = None,
          error: Optional[torch.Tensor] = None) -> None:
    """bnb's update of every segment of a flat partition in place, arguments as the fused operator's (ops/rules.py,
    one tensor per moment in codes/absmax/state/qmaps; hyper: BnbHyper rows, as the fp32 tensor the kernels read or
    as BnbHyper objects, whose values bnb then gets unrounded, as update_step hands them on a CPU). Needs bnb's
    update on params' device."""
    import bitsandbytes.functional as F
    two = len(codes) == 2
    rows = hyper.detach().cpu().double().tolist() if torch.is_tensor(hyper) else [r.row() for r in hyper]
    for whole, row in _segments(segments.detach().cpu()):
        beta1, beta2, eps, weight_decay, lr, step, gnorm_scale = rows[row]
        for piece in split_segment(whole, MAX_UPDATE_NUMEL):
            p = params.narrow(0, piece.offset, piece.numel)
            g = grads.narrow(0, piece.offset, piece.numel).clone()
            if inv_scale is not None:  # DeepSpeed's grad.mul_(1 / combined_scale), with the factor's own tensor
                g.mul_(inv_scale)
            hi = lo = None
            if error is not None:  # bnb steps the widened fp32 weight (optim/bnb_adapter.py)
                hi, lo = p, error.narrow(0, piece.offset, piece.numel)
                p, g = compensated.join(hi, lo), g.float()
            if piece.eight_bit:
                first, blocks = piece.offset // BLOCK_SIZE, -(-piece.numel // BLOCK_SIZE)
                F.optimizer_update_8bit_blockwise(
                    rule, g, p, codes[0].narrow(0, piece.offset, piece.numel),
                    codes[1].narrow(0, piece.offset, piece.numel) if two else None, beta1, beta2, 0.0, 0.0, eps,
                    int(step), lr, qmaps[0], qmaps[1] if two else None, absmax[0].narrow(0, first, blocks),
                    absmax[1].narrow(0, first, blocks) if two else None, weight_decay, gnorm_scale=gnorm_scale)
            else:
                start = piece.fp32_offset
                F.optimizer_update_32bit(
                    rule, g, p, state[0].narrow(0, start, piece.numel), beta1, eps, int(step), lr,
                    state[1].narrow(0, start, piece.numel) if two else None, beta2, 0.0, 0.0, weight_decay,
                    gnorm_scale)
            if error is not None:
                compensated.split_(p, hi, lo)


def cpu32_oracle(update, configs: Sequence[dict], step: int):
    """The oracle of the bnb_cpu arithmetic against bitsandbytes itself, with the fused operator's arguments, for the
    update rule `update` (its ops/rules.py entry): bnb's own update of the fp32 segments (its 32-bit CPU update, with
    the unrounded values of the bnb get_config dicts `configs`, one per hyper row, at bnb's step `step`), and the
    pure-torch reference of the 8-bit ones (which bnb_cpu computes in the ieee arithmetic). The operator's own `hyper`
    argument is read for the 8-bit segments only."""
    n = update.moments
    bnb_rows = [BnbHyper.of(config, step) for config in configs]

    def oracle(params, grads, *rest):
        segments, hyper, inv_scale, error = rest[4 * n:4 * n + 4]
        eight_bit = segments[:, 2] != 0
        update.reference(params, grads, *rest[:4 * n], segments[eight_bit], hyper, inv_scale, error, reference.IEEE)
        step_(update.name, params, grads, rest[:n], rest[n:2 * n], rest[2 * n:3 * n], rest[3 * n:4 * n],
              segments[~eight_bit], bnb_rows, inv_scale, error)
    return oracle
