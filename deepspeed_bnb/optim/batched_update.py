"""bitsandbytes' own 32-bit update of many small segments of a partition in one call: gathered, stepped, put back.

Why: the parameters with 32-bit state (biases and norms: bnb keeps tensors below min_8bit_size in fp32) are each one
bnb update call of about ten torch operations over a few hundred elements; a transformer has two or three per layer,
so on a CPU (ZeRO-Offload, CPU training) their Python and dispatch cost outweighs their arithmetic. bnb's 32-bit
update of an element-wise rule is a sequence of element-wise torch operations with scalar hyper-parameters, so one
call over the concatenation of several segments gives every element the bits it gets in a call of its own, provided
torch's CPU kernels round an element the same wherever it sits in a tensor (vectorized body or scalar tail, any
thread's chunk). That is checked once per process and rule on a probe (`position_invariant`, bnb's own update both
ways); where it does not hold, every segment keeps a call of its own.
Not batched: 8-bit segments (blockwise: the fused kernel's, or bnb's per segment), a config with a trust ratio
(max_unorm > 0: a norm over the call), rules outside ELEMENT_WISE (AdEMAMix keeps two rows in its state), GPUs (bnb's
f32 CUDA SGD-momentum kernel rounds an element by its index mod 4 in the call), segments of more than MAX_SEGMENT
elements (the copies would cost what the call saves).
"""

from typing import Callable, Dict, List, Sequence

import torch

from deepspeed_bnb.state_layout import Segment

ELEMENT_WISE = ("adam", "lion", "momentum", "rmsprop", "adagrad")  # bnb rules whose 32-bit update is element-wise
MAX_SEGMENT = 1 << 16  # elements of a segment that may join a batch
PROBE_SIZES = (1, 97, 301, 4099, 40000)  # odd sizes: vector bodies, scalar tails, a chunk split across threads
_probed: Dict[str, bool] = {}  # rule -> what its probe found (a probe that could not run is not kept)


def runs(segments: Sequence[Segment], overrides: Sequence[dict], batchable: Callable[[Segment, dict], bool],
         limit: int) -> List[List[int]]:
    """Indices of `segments` grouped into runs stepped by one call each: consecutive 32-bit segments that
    `batchable` admits, with equal overrides and adjacent packed fp32 state, at most `limit` elements together (the
    elements one bnb call may take); every other segment alone."""
    grouped: List[List[int]] = []
    total = 0  # elements of the last run
    for i, (segment, override) in enumerate(zip(segments, overrides)):
        if grouped and batchable(segment, override) and total + segment.numel <= limit:
            last = segments[grouped[-1][-1]]
            if (batchable(last, overrides[grouped[-1][-1]]) and overrides[grouped[-1][-1]] == override
                    and last.fp32_offset + last.numel == segment.fp32_offset):
                grouped[-1].append(i)
                total += segment.numel
                continue
        grouped.append([i])
        total = segment.numel
    return grouped


def positions(run: Sequence[Segment], device) -> torch.Tensor:
    """The partition positions of a run's elements in order, for one index_select / index_copy_ instead of a narrow
    and a copy per segment: a few tensor operations whatever the number of segments, and nothing kept between steps
    (a cache of them would be memory no one plans for)."""
    lengths = [s.numel for s in run]
    shifts, at = [], 0  # each segment's offset minus the elements before it in the run
    for segment in run:
        shifts.append(segment.offset - at)
        at += segment.numel
    return torch.arange(at, device=device) + torch.repeat_interleave(
        torch.tensor(shifts, device=device), torch.tensor(lengths, device=device), output_size=at)


def allowed(rule: str, device) -> bool:
    """Whether 32-bit segments of bnb's `rule` may be batched on `device` (the probe runs once per rule)."""
    return torch.device(device).type == "cpu" and rule in ELEMENT_WISE and position_invariant(rule)


def position_invariant(rule: str) -> bool:
    """bnb's 32-bit CPU update of `rule` gives each element the same bits alone and inside a concatenation (two
    steps, weight decay on, odd sizes), on this machine with this torch; probed once per rule (False, and probed
    again next time, where bnb has no CPU update to probe)."""
    if rule not in _probed:
        found = _probe(rule)
        if found is None:
            return False
        _probed[rule] = found
    return _probed[rule]


def _probe(rule: str):
    import bitsandbytes.functional as F
    two = rule == "adam"
    g = torch.Generator().manual_seed(0)
    parts = [[torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2, torch.randn(n, generator=g).abs()
              * 1e-3, torch.rand(n, generator=g) * 1e-5] for n in PROBE_SIZES]
    joined = [torch.cat([p[k] for p in parts]) for k in range(4)]
    try:
        for step in (1, 2):
            for p, grad, s1, s2 in [*parts, joined]:
                F.optimizer_update_32bit(rule, grad, p, s1, 0.9, 1e-8, step, 1e-3, s2 if two else None, 0.999, 0.0,
                                         0.0, 0.01, 1.0)
    except Exception:  # bnb without a CPU update here (0.49): nothing to batch, nothing learnt
        return None
    for k in (0, 2, 3) if two else (0, 2):
        alone = torch.cat([p[k] for p in parts])
        if not torch.equal(alone.view(torch.int32), joined[k].view(torch.int32)):
            return False
    return True
