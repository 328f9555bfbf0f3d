"""A checkpoint's per-parameter values in fp32: the consolidated weights (what DeepSpeed's zero_to_fp32 gives) and a
parameter's optimizer-state rows with 8-bit codes dequantized. Read through SavedCheckpoint (safe loader, manifest)."""

from typing import Dict

import torch

from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.ops.reference import dequantize_blockwise


def fp32_moments(state: dict) -> list:
    """A parameter's state rows as fp32 tensors, in TORCH_NAMES order (8-bit codes dequantized)."""
    rows = []
    for i in (1, 2):
        key = f"state{i}"
        if key not in state:
            continue
        value = state[key]
        if value.dtype == torch.uint8:
            value = dequantize_blockwise(value, state[f"absmax{i}"], state[f"qmap{i}"])
        rows.extend(value.unbind(0) if value.dim() == 2 else [value])
    return rows


def consolidated_weights(ckpt: SavedCheckpoint) -> Dict[str, torch.Tensor]:
    """fp32 weights of every trained parameter, plus the model's other tensors (buffers, frozen) as saved."""
    states = ckpt.model_states
    weights = {name: tensor for name, tensor in states["module"].items()}
    for g, shapes in enumerate(ckpt.param_shapes()):
        for (name, shape), master in zip(shapes.items(), ckpt.master_weights(g)):
            weights[name] = master.reshape(shape).clone()
    for name, source in states.get("shared_params", {}).items():
        weights[name] = weights[source]  # tied weights: the same tensor under both names
    return weights
