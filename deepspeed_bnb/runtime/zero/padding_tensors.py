"""Block-aligned ZeRO-1/2 flat groups on DeepSpeed releases without per-parameter padding: zero padding tensors.

DeepSpeed 0.19.7 added per-parameter padding inside ZeRO-1/2 flat groups (`round_robin_bit16_padding`), and
BnbZeroOptimizer chooses the block-aligned layout through it. Earlier releases lay a group out as its parameters back
to back, and compute every offset (gradient partitions, `get_partition_info`, the offload gradient positions, the
model's views into the flat buffer) by adding up `numel()` along their lists. So instead of teaching each of those
functions about gaps, the gaps are made of tensors: at the moment DeepSpeed flattens a group
(`flatten_dense_tensors_aligned`, called from its `__init__` right after it built the group's lists), a zero tensor
is placed after every parameter that does not end on a block boundary, in the lists DeepSpeed walks:
- `round_robin_bit16_groups[i]` (the flat order) and `round_robin_bit16_meta[i]`: right after the parameter it pads;
- `bit16_groups[i]`: appended at the end, so that the positions of real parameters (`param_idx_in_group`, the key
  of the stage-2 gradient bucket) do not move; `round_robin_bit16_indices[i]` maps every position to the flat one.
DeepSpeed then sums along lists whose offsets are exactly those of state_layout.GroupLayout, with its own code.

A padding tensor is a parameter of no module: it never receives a gradient, DeepSpeed reads a zero gradient for it
(`get_flat_partition` zero-fills missing gradients), it adds nothing to the gradient norm, and the segment table of
the step skips it, so it stays exactly zero. What must not see it is kept from seeing it:
- DeepSpeed's hp mappings (`_param_slice_mappings` looks every mapped parameter up by name): linked for the offsets,
  then unlinked (`unlink`);
- the model-states `param_shapes` (DeepSpeedEngine._get_zero_param_shapes names every flat entry): `hidden`;
- deepspeed_bnb's own records and layouts, which use the real parameters only (`real`).
The checkpoint files are the same as on releases with per-parameter padding: records, master weights, group paddings
and `param_alignment_paddings` are written from the layout, not from these lists.
"""

import contextlib
from typing import List

import torch

PADDING_ATTR = "ds_bnb_padding"  # True on the zero tensors placed between parameters
MOE_ATTRS = ("allreduce", "group_name")  # DeepSpeed's expert-parameter marks: a gap belongs to its parameter's kind


def is_padding(param) -> bool:
    return bool(getattr(param, PADDING_ATTR, False))


def real(params) -> list:
    """`params` without padding tensors."""
    return [p for p in params if not is_padding(p)]


def refuse_unsupported(optimizer, kwargs: dict) -> None:
    """Settings under which DeepSpeed treats a parameter without a gradient as an error: refused at construction."""
    offload = kwargs.get("offload_optimizer_config")
    device = getattr(getattr(offload, "device", None), "value", "none")  # OffloadDeviceEnum
    if not kwargs.get("ignore_unused_parameters", True) and device != "none":
        raise NotImplementedError(
            f"deepspeed_bnb: zero_optimization.ignore_unused_parameters: false with offload_optimizer asserts on "
            f"every parameter without a gradient, and on this DeepSpeed release the block-aligned layout of "
            f"{type(optimizer).__name__}'s state places zero padding tensors (parameters without gradients) between "
            f"the model's parameters. Remove ignore_unused_parameters (true is the default), or use DeepSpeed 0.19.7 "
            f"or later (per-parameter padding).")


def _padding_tensor(numel: int, after: torch.nn.Parameter, meta: torch.Tensor, use_cpu_data: bool):
    pad = torch.nn.Parameter(torch.zeros(numel, dtype=meta.dtype, device=after.device))
    setattr(pad, PADDING_ATTR, True)
    pad.grad_accum = None  # DeepSpeed sets it on every trainable parameter (fp32 gradient accumulation reads it)
    if use_cpu_data:  # DeepSpeed flattens from, then deletes, `cpu_data` of every parameter of the group
        pad.cpu_data = torch.zeros(numel, dtype=meta.dtype)
    for attr in MOE_ATTRS:
        if hasattr(after, attr):
            setattr(pad, attr, getattr(after, attr))
    return pad


def place(zero, i: int, paddings: List[int], use_cpu_data: bool) -> list:
    """Put the padding tensors of param group `i` (`paddings`: zeros after each parameter, in flat order) into
    DeepSpeed's lists; returns the group's new flat-order list, the one to flatten."""
    flat, meta = zero.round_robin_bit16_groups[i], zero.round_robin_bit16_meta[i]
    if len(flat) != len(paddings) or any(is_padding(p) for p in flat):
        raise RuntimeError(f"deepspeed_bnb: param group {i} has {len(flat)} parameters in DeepSpeed's flat order and "
                           f"{len(paddings)} paddings; this DeepSpeed release builds its ZeRO-1/2 groups another way.")
    bit16 = zero.bit16_groups[i]
    new_flat, new_meta = [], []
    for param, param_meta, padding in zip(list(flat), list(meta), paddings):  # bit16 may be `flat`: it grows
        new_flat.append(param)
        new_meta.append(param_meta)
        if padding:
            pad = _padding_tensor(padding, param, param_meta, use_cpu_data)
            pad.param_idx_in_group = len(bit16)  # DeepSpeed's position of a trainable parameter in bit16_groups[i]
            bit16.append(pad)
            new_flat.append(pad)
            new_meta.append(torch.zeros(padding, dtype=param_meta.dtype, device="meta"))
    position = {id(p): k for k, p in enumerate(new_flat)}
    zero.round_robin_bit16_groups[i] = new_flat  # a new list: without round robin it was bit16_groups[i] itself
    meta[:] = new_meta
    # bit16 position -> flat position: a list, or a dict after DeepSpeed's round-robin reorder
    indices = zero.round_robin_bit16_indices[i]
    moved = [position[id(p)] for p in bit16]
    if isinstance(indices, dict):
        indices.clear()
        indices.update(enumerate(moved))
    else:
        indices[:] = moved
    return new_flat


def unlink(zero) -> None:
    """Drop the hp mappings DeepSpeed's `_link_all_hp_params` gave padding tensors (they map zeros to nothing)."""
    for group in zero.bit16_groups:
        for param in group:
            if is_padding(param):
                param._hp_mapping = None


@contextlib.contextmanager
def flat_order(zero):
    """Within the block, `bit16_groups` is the flat order with the padding tensors: DeepSpeed's `link_hp_params`
    counts each parameter's offset along the list it is given (releases before per-parameter padding)."""
    kept = zero.bit16_groups
    zero.bit16_groups = zero.round_robin_bit16_groups
    try:
        yield
    finally:
        zero.bit16_groups = kept


@contextlib.contextmanager
def hidden(zero):
    """Within the block, DeepSpeed's group lists hold the real parameters only (what a checkpoint names)."""
    kept = zero.bit16_groups, zero.round_robin_bit16_groups
    zero.bit16_groups = [real(g) for g in kept[0]]
    zero.round_robin_bit16_groups = [real(g) for g in kept[1]]
    try:
        yield
    finally:
        zero.bit16_groups, zero.round_robin_bit16_groups = kept
