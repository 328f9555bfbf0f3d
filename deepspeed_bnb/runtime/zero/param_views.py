"""Where a ZeRO-1/2 param group's model parameters view its flat buffer, to tell when DeepSpeed's re-pointing is moot.

DeepSpeed's stage-1/2 step ends by calling `_update_model_bit16_weights` for every param group ("TODO: we probably
don't need this? just to be safe", DeepSpeed 0.16-0.19): it assigns each parameter's `.data` a view of the group's
flat buffer again, two assignments per parameter, each a few Python-level tensor operations (on a CPU about 200 us a
step for the demo GPT's 53 parameters, every step, for views that have not moved). A record of what the last call
left (ParamViews) answers whether another would change anything: the same buffer at the same address, and every
tensor it assigned still with the data pointer, shape, strides and dtype it left. Where that holds the call is
skipped; where anything moved (a buffer replaced or freed, a `.data` reassigned by a user or another feature)
DeepSpeed's own method runs, so parameters end up exactly where DeepSpeed would put them.
"""

from dataclasses import dataclass
from typing import Iterable, Tuple

import torch


def _view_of(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype


@dataclass(frozen=True)
class ParamViews:
    """One param group's flat buffer and the tensors DeepSpeed pointed into it, as its last re-pointing left them."""

    flat: torch.Tensor  # the group's flat buffer (DeepSpeed's bit16_groups_flat[i]) the tensors were pointed at
    flat_ptr: int  # its data pointer then: a buffer moved, freed or resized since reads another
    views: Tuple[Tuple[torch.Tensor, tuple], ...]  # per tensor DeepSpeed assigns: (the tensor, _view_of it then)

    @classmethod
    def of(cls, flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> "ParamViews":
        """The record of `flat` and `tensors` (each once, in order) now, right after DeepSpeed pointed them."""
        unique = {id(t): t for t in tensors}.values()
        return cls(flat, flat.data_ptr(), tuple((t, _view_of(t)) for t in unique))

    def hold(self, flat: torch.Tensor) -> bool:
        """True when re-pointing into `flat` (the group's buffer now) would change nothing: the same buffer at the same
        address, and every tensor as recorded."""
        if flat is not self.flat or flat.data_ptr() != self.flat_ptr:
            return False
        return all(_view_of(tensor) == view for tensor, view in self.views)
