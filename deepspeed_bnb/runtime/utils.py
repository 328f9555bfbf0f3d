"""Whether any of many gradient pieces holds an inf or a NaN, in a few operations instead of seven per piece; and
DeepSpeed's per-parameter host reads under CPU offload, batched.

Mirrors deepspeed/runtime/utils.py (`has_inf_or_nan`). Before every ZeRO-1/2 step in fp16, and in bf16 where
`bf16.check_grad_overflow` is on (a key since DeepSpeed 0.17.1, on by default since 0.19.3), DeepSpeed asks
`has_inf_or_nan` of each gradient piece in turn: amax, amin, two isfinite, logical_and, logical_not and an add per
piece (0.19.8; earlier releases copy the piece to fp32 and test isnan and isinf). On a GPU each of those is a kernel
launch of its own, ~1,700 for a GPT of 245 parameters, where the host, not the device, sets the pace (on an H200 at 1B
the check took 59 ms of a 101 ms step); on the CPU they were a quarter of a bf16 demo step.

`any_inf_or_nan` answers the same question with one fp64 2-norm per piece (`torch._foreach_norm`: one launch for up to
several hundred pieces on a GPU) and their sum. The answer is exactly DeepSpeed's:
- a piece with an inf or a NaN has a non-finite norm (inf squared is inf, NaN stays NaN, and the squares are never
  negative, so no inf - inf), and a sum with a non-finite term is non-finite;
- a piece of finite values has a finite norm, whatever the summation order: the largest fp32 value squared is
  1.2e77, so even 2^63 of them sum to ~1.1e96, far below fp64's 1.8e308 (fp16 and bf16 values are fp32 values).
torch accumulates `_foreach_norm(..., dtype=torch.float64)` in fp64 on every device (its CUDA kernel's accumulator
is the output dtype's opmath type; the CPU path calls linalg.vector_norm with that dtype).
On the CPU there are no launches to save, and torch's fp64 norm runs at ~0.3G elements/s per core there against ~6-10G
for `torch.aminmax` (16M elements, one AMD Zen 5 core), so pieces on the CPU are judged by their smallest and largest
values instead: both are finite exactly when the piece holds no inf and no NaN (a NaN propagates to both, +inf is the
largest, -inf the smallest). That rests on torch's CPU reduction propagating a NaN from any position, which a probe
checks once per process (`_extremes_see_nan`: vector bodies, tails, a chunk per thread); where it does not, the fp64
norms answer there too.
"""

from typing import Iterable, Optional

import torch


def any_inf_or_nan(pieces: Iterable[Optional[torch.Tensor]], device) -> torch.Tensor:
    """A bool tensor of shape [1] on `device`: True when some piece holds an inf or a NaN (None and empty pieces are
    skipped), as DeepSpeed's has_overflow_partitioned_grads_serial returns it. Never reads the answer back to the
    host."""
    dense = [values for values in (stored_values(piece) for piece in pieces if piece is not None) if values.numel()]
    if not dense:
        return torch.zeros([1], dtype=torch.bool, device=device)
    if all(_judged_by_extremes(values) for values in dense):
        extremes = [bound for values in dense for bound in torch.aminmax(values)]
        if len({bound.dtype for bound in extremes}) > 1:  # stacked as fp64: exact for every floating dtype
            extremes = [bound.double() for bound in extremes]
        return torch.stack(extremes).isfinite().all().logical_not().reshape(1).to(device)
    total = torch.stack(torch._foreach_norm(dense, 2.0, dtype=torch.float64)).sum()
    return total.isfinite().logical_not().reshape(1).to(device)


_EXTREMES_PROBED: list = []  # [whether torch.aminmax sees a NaN or an inf anywhere on this CPU], once probed
_FP32_VALUES = (torch.float32, torch.bfloat16, torch.float16)  # gradient dtypes whose values are fp32 values


def _judged_by_extremes(values: torch.Tensor) -> bool:
    """Whether `values` are judged by their smallest and largest values (torch.aminmax) rather than an fp64 norm: on
    the CPU, in a dtype the probe covered, where the probe saw torch propagate a NaN and an inf to the bounds."""
    return values.device.type == "cpu" and values.dtype in _FP32_VALUES and _extremes_see_nan()


def _extremes_see_nan() -> bool:
    """Whether torch.aminmax on the CPU returns a non-finite bound for a NaN, +inf or -inf at any position (the first,
    vector bodies and tails of odd sizes, each thread's chunk of a large piece), for each floating dtype a gradient
    has; probed once per process."""
    if not _EXTREMES_PROBED:
        seen = True
        try:
            for dtype in _FP32_VALUES:
                for size in (1, 31, 257, 100_003):
                    for position in {0, size // 2, size - 1}:
                        for bad in (float("nan"), float("inf"), float("-inf")):
                            piece = torch.ones(size, dtype=dtype)
                            piece[position] = bad
                            low, high = torch.aminmax(piece)
                            seen &= not bool(low.isfinite() & high.isfinite())
        except RuntimeError:  # a torch without aminmax for one of these dtypes on the CPU: the norms answer
            seen = False
        _EXTREMES_PROBED.append(seen)
    return _EXTREMES_PROBED[0]


def inf_or_nan_term(piece: torch.Tensor) -> torch.Tensor:
    """A 0-dim fp64 tensor on `piece`'s device that is finite exactly when `piece` holds no inf and no NaN (its fp64
    2-norm; on the CPU, for fp32, bf16 and fp16 values, its largest minus its smallest value, at most twice fp32's
    largest: a sum of such terms answers for all of them, as any_inf_or_nan's does). Reads nothing back."""
    values = stored_values(piece)
    if values.numel() and _judged_by_extremes(values):
        low, high = torch.aminmax(values)
        return high.double() - low.double()
    return torch.linalg.vector_norm(values, 2.0, dtype=torch.float64)


def stored_values(piece: torch.Tensor) -> torch.Tensor:
    """The values of `piece` that can be non-finite, detached: a sparse tensor's stored ones (its implicit zeros
    cannot be), a dense tensor itself."""
    return (piece._values() if piece.is_sparse else piece).detach()


def on_host(values: dict) -> Optional[dict]:
    """`values` (0-dim tensors of one dtype) with every tensor copied to the host in one transfer, as a new dict in
    the same order; None when they are not all 0-dim tensors of one dtype (the caller then reads them one by one)."""
    tensors = list(values.values())
    if not tensors or any(not torch.is_tensor(t) or t.dim() != 0 or t.dtype != tensors[0].dtype for t in tensors):
        return None
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    return dict(zip(values, torch.stack(tensors).cpu().unbind()))
