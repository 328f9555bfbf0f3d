"""What each bitsandbytes optimizer-state key is (element, block, whole, scalar, scratch); how unknown ones are judged.

Stock ZeRO treats every state tensor as one value per element: it trims, concatenates and re-splits the 256-entry
quantization maps and the per-block absmax as if they were moments. Here each key has a class that says how it is
partitioned, saved and resharded. The registry gives the classes bitsandbytes 0.50 uses; a key it does not know (a
custom subclass, a future bnb) is classified by its shape, the user's `bnb_keep_whole` list and
`bnb_keep_whole_threshold`, and a key that fits no class is an error naming the key and the knob.
"""

import enum
from typing import Dict, Iterable

import torch

from deepspeed_bnb.state_layout import BLOCK_SIZE, num_blocks


FP32_PREFIX = "fp32."  # flat-state keys of fp32-precision segments (their own compact element space)


class StateClass(str, enum.Enum):
    ELEMENT = "element"  # one value per parameter element (codes, fp32 moments); leading rows allowed (AdEMAMix)
    BLOCK = "block"  # one value per 256-element block (absmax); leading rows allowed
    WHOLE = "whole"  # the same tensor for every parameter and rank (quantization maps): replicated, never split
    SCALAR = "scalar"  # a Python number or 0-dim tensor per parameter (step)
    SCRATCH = "scratch"  # written by every step before anything reads it; not checkpointed (LAMB/LARS unorm_vec)

    # What each class means for a cut, written once here rather than as a switch in every caller that cuts state:
    @property
    def partitioned(self) -> bool:
        """Cut with the parameter (one value per element or per block); whole, scalar and scratch keys are not."""
        return self in (StateClass.ELEMENT, StateClass.BLOCK)

    def length(self, numel: int, block: int = BLOCK_SIZE):
        """The last dimension of this class's tensor for `numel` elements; None where it does not follow numel."""
        return {StateClass.ELEMENT: numel, StateClass.BLOCK: num_blocks(numel, block)}.get(self)

    def narrow(self, value: torch.Tensor, start: int, numel: int, block: int = BLOCK_SIZE) -> torch.Tensor:
        """The values of elements [start, start + numel) in `value`, a partitioned tensor whose last dimension counts
        elements from 0 (a block key: the blocks, `start` on a block boundary)."""
        if self == StateClass.ELEMENT:
            return value.narrow(-1, start, numel)
        if self == StateClass.BLOCK:
            return value.narrow(-1, start // block, num_blocks(numel, block))
        raise ValueError(f"{self.value} state is not cut with the parameter")


_TWO_STATE = {
    "step": StateClass.SCALAR,
    "state1": StateClass.ELEMENT,
    "state2": StateClass.ELEMENT,
    "absmax1": StateClass.BLOCK,
    "absmax2": StateClass.BLOCK,
    "qmap1": StateClass.WHOLE,
    "qmap2": StateClass.WHOLE,
    # bnb writes the update norm here for the trust ratio (max_unorm > 0) and never reads it back in a later step.
    "unorm_vec": StateClass.SCRATCH,
}
_ONE_STATE = {k: v for k, v in _TWO_STATE.items() if not k.endswith("2")}

REGISTRY: Dict[str, Dict[str, StateClass]] = {
    # keyed by bnb's `optimizer_name`, which selects the update rule inside bnb's kernels
    "adam": _TWO_STATE,  # Adam, AdamW (+8bit/32bit/Paged)
    "lamb": _TWO_STATE,
    "ademamix": _TWO_STATE,  # state1/absmax1 carry two rows: fast and slow EMA
    "momentum": _ONE_STATE,  # SGD with momentum
    "lars": _ONE_STATE,
    "rmsprop": _ONE_STATE,
    "adagrad": _ONE_STATE,
    "lion": _ONE_STATE,
}


class StateClassError(ValueError):
    """An optimizer-state key that cannot be partitioned safely."""


def _fits(value: torch.Tensor, length: int) -> bool:
    return value.dim() in (1, 2) and value.shape[-1] == length


def classify(key: str, value, probe_numel: int, optimizer_name: str, keep_whole: Iterable[str],
             threshold: int) -> StateClass:
    """Class of one state entry that bnb created for a probe parameter of `probe_numel` elements.

    The probe size is a multiple of the block size with more than one block (so element, block and the 256-entry maps
    have distinct shapes). Order: scalars; the user's `bnb_keep_whole` list; the registry; then shape rules.
    """
    if not torch.is_tensor(value) or value.dim() == 0:
        return StateClass.SCALAR
    blocks = num_blocks(probe_numel)
    per_element, per_block = _fits(value, probe_numel), _fits(value, blocks)
    where = (f"optimizer state key {key!r} (shape {tuple(value.shape)}, {value.dtype}) of bnb optimizer "
             f"'{optimizer_name}'")
    if key in keep_whole:
        if per_element or per_block:
            raise StateClassError(
                f"{where} is listed in zero_optimization.bnb_keep_whole, but it holds one value per parameter "
                f"{'element' if per_element else 'block'}: each rank owns different values, so it cannot be "
                f"replicated. Remove {key!r} from bnb_keep_whole.")
        return StateClass.WHOLE
    known = REGISTRY.get(optimizer_name, {}).get(key)
    if known is not None:
        expected = {StateClass.ELEMENT: per_element, StateClass.BLOCK: per_block}.get(known, True)
        if not expected:
            raise StateClassError(f"{where} should be {known.value}-shaped (bitsandbytes 0.50 layout) but is not; "
                                  f"this bitsandbytes version is not supported by deepspeed_bnb.")
        return known
    if per_element:
        return StateClass.ELEMENT
    if per_block:
        return StateClass.BLOCK
    if value.numel() <= threshold:
        return StateClass.WHOLE
    raise StateClassError(
        f"{where} fits no state class: it is neither one value per parameter element ({probe_numel} in the probe) "
        f"nor one per 256-element block ({blocks}), and its {value.numel()} elements exceed "
        f"zero_optimization.bnb_keep_whole_threshold={threshold}. If it is identical for every parameter (like a "
        f"quantization map), add {key!r} to zero_optimization.bnb_keep_whole or raise bnb_keep_whole_threshold.")


def zeros_like_partitioned(cls: StateClass, template: torch.Tensor, elements: int, device=None) -> torch.Tensor:
    """Zero storage of an element- or block-class key for `elements` partition elements, with the template's leading
    rows and dtype (AdEMAMix keeps two rows)."""
    length = elements if cls == StateClass.ELEMENT else elements // BLOCK_SIZE
    return template.new_zeros((*template.shape[:-1], length), device=device)
