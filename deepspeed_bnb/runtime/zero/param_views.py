"""Where the tensors DeepSpeed points into a flat buffer view it, to tell when its per-step re-pointing is moot.

DeepSpeed's ZeRO steps end by pointing tensors at their flat buffer again, every step, for views that have not moved:
stages 1/2 call `_update_model_bit16_weights` for every param group ("TODO: we probably don't need this? just to be
safe", DeepSpeed 0.16-0.19), two `.data` assignments per parameter; stage 3 calls `_unflatten_partitioned_parameters`
for every sub-group, one per parameter partition. Each assignment is a few Python-level tensor operations: about 200 us
a step on a CPU for the demo GPT's 53 parameters, 3.5 ms a step for a 1B GPT's 245 on an H200's host. A record of what
the last call left (ParamViews) answers whether another would change anything: the same buffer at the same address,
and the same tensors in DeepSpeed's lists, each still with the data pointer, shape, strides and dtype it left. Where
that holds, the call is skipped (`repoint`); where anything moved (a buffer replaced or freed, a `.data` reassigned by
a user or another feature, a tensor replaced in the list), DeepSpeed's own method runs, so tensors always end up
exactly where DeepSpeed would put them.
"""

import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence, Tuple

import torch


def _view_of(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


@dataclass(frozen=True)
class ParamViews:
    """One group's flat buffer and the tensors DeepSpeed pointed into it, as its last re-pointing left them."""

    flat: torch.Tensor  # the group's flat buffer the tensors were pointed at
    flat_ptr: int  # its data pointer then: a buffer moved, freed or resized since reads another
    tensors: Tuple[torch.Tensor, ...]  # the tensors DeepSpeed's lists held, in their order (a tensor may recur)
    views: Tuple[Tuple[torch.Tensor, tuple], ...]  # per distinct tensor of those: (it, _view_of it)

    @classmethod
    def of(cls, flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> "ParamViews":
        """The record of `flat` and `tensors` now, right after DeepSpeed pointed them."""
        tensors = tuple(tensors)
        distinct = {id(t): t for t in tensors}.values()
        return cls(flat, flat.data_ptr(), tensors, tuple((t, _view_of(t)) for t in distinct))

    def hold(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> bool:
        """True when re-pointing `tensors` (those DeepSpeed's lists hold now) into `flat` (the group's buffer now)
        would change nothing: the same buffer at the same address, the same tensors, each viewing what it did."""
        if flat is not self.flat or flat.data_ptr() != self.flat_ptr or len(tensors) != len(self.tensors):
            return False
        # identity first, at C speed (map over operator.is_); a training step's cold caches make Python loops dear
        return all(map(operator.is_, tensors, self.tensors)) and all(
            _view_of(tensor) == view for tensor, view in self.views)


def repoint(optimizer, key, flat: torch.Tensor, deepspeeds: Callable[[], None],
            tensors: Callable[[], Sequence[torch.Tensor]]) -> None:
    """Run `deepspeeds` (DeepSpeed's re-pointing of `tensors()` into `flat`, of the group or sub-group `key`) unless the
    record its last run left for `key` on `optimizer` still holds; then record them. The records live in the
    optimizer's `_bnb_param_views` (DeepSpeed's __init__ makes the first call, before any attribute of ours)."""
    records = optimizer.__dict__.setdefault("_bnb_param_views", {})
    record = records.get(key)
    if record is not None and record.hold(flat, tensors()):
        return
    deepspeeds()
    records[key] = ParamViews.of(flat, tensors())
