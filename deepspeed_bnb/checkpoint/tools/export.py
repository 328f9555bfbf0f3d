"""Offline export: consolidated fp32 weights (safetensors) and, optionally, dequantized optimizer state by name.

The weights are what DeepSpeed's zero_to_fp32 produces (fp32 master weights joined per parameter, buffers and
untrained parameters from the model states). The optimizer state is every parameter's bnb state as fp32 under the
names torch's optimizers use (Adam: `exp_avg`, `exp_avg_sq`, `step`), so other tools can read it.
"""

import contextlib
import json
import os
from typing import Dict

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import LATEST_UNIVERSAL
from deepspeed_bnb.checkpoint.format.merged import open_whole_model
from deepspeed_bnb.checkpoint.format.publish import replacing
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.weights import consolidated_weights, fp32_moments
from deepspeed_bnb.checkpoint.tools.rank_files import check_output
from deepspeed_bnb.optim.state_names import TORCH_NAMES


def export(path: str, out_dir: str, optimizer_state: bool = False, progress: bool = True,
           universal: bool = False, stock: bool = False) -> Dict[str, str]:
    """Write `model.safetensors` (and `optimizer.safetensors` + `optimizer.json`) into `out_dir`, or with `universal`
    a DeepSpeed universal checkpoint (universal.py: the 8-bit kind, or with `stock` torch AdamW's; a tensor- or
    pipeline-parallel checkpoint's ranks joined, format/merged.py); returns paths (and, for a joined one, what joining
    requantized). Every input file is checked against its SHA-256 first."""
    if stock and not universal:
        raise ValueError("export: --stock chooses the kind of universal checkpoint; add --universal")
    if universal:
        from deepspeed_bnb.checkpoint.tools.universal import write_universal
        ckpt = open_whole_model(path)
        written = {"universal": write_universal(ckpt, out_dir, progress, stock),
                   "pointer": os.path.join(out_dir, LATEST_UNIVERSAL)}
        if ckpt.model_parallel > 1:  # its tensor-parallel ranks and pipeline stages joined (format/merged.py)
            written["joined"] = (f"{ckpt.tp_size} tensor-parallel x {ckpt.pp_size} pipeline ranks; "
                                 f"{ckpt.requantized}")
        return written
    ckpt = SavedCheckpoint(path, verify_checksums=True)
    ckpt.refuse_model_parallel("deepspeed-bnb export")
    check_output(ckpt, out_dir)
    weights = consolidated_weights(ckpt)
    optimizer = _optimizer_state(ckpt, progress) if optimizer_state else None
    os.makedirs(out_dir, exist_ok=True)
    written = {"model": os.path.join(out_dir, "model.safetensors")}
    if optimizer is not None:
        written.update(optimizer=os.path.join(out_dir, "optimizer.safetensors"),
                       param_groups=os.path.join(out_dir, "optimizer.json"))
    # each file written beside its name and renamed into place when all are written: a failed export leaves nothing,
    # and a link standing at an output name is replaced, not written through
    with contextlib.ExitStack() as outputs:
        tmp = {kind: outputs.enter_context(replacing(path)) for kind, path in written.items()}
        save_file({k: v.contiguous() for k, v in _untie(weights).items()}, tmp["model"],
                  metadata={"source": ckpt.tag_dir, "format": "fp32 master weights"})
        if optimizer is not None:
            tensors, description = optimizer
            save_file(tensors, tmp["optimizer"], metadata={"optimizer_class": description["optimizer_class"]})
            with open(tmp["param_groups"], "w") as f:
                json.dump(description, f, indent=1, default=str)
    return written


def _optimizer_state(ckpt: SavedCheckpoint, progress: bool):
    """(every parameter's optimizer state in fp32 under torch's names, the optimizer.json description)."""
    record = ckpt.record(0)
    names = TORCH_NAMES.get(record[C.OPTIMIZER_NAME_KEY])
    if names is None:
        raise CheckpointMismatchError(f"{ckpt.source.name(0)} holds state of the bnb update rule "
                                      f"{record[C.OPTIMIZER_NAME_KEY]!r}, which has no torch names to export it under "
                                      f"(known: {sorted(TORCH_NAMES)}).")
    tensors, groups = {}, []
    for g, shapes in enumerate(ckpt.param_shapes()):
        per_param = ckpt.param_states(g)
        for (name, shape), state in tqdm(list(zip(shapes.items(), per_param)), desc=f"group {g} state",
                                         disable=not progress):
            for label, value in zip(names, fp32_moments(state)):
                tensors[f"{name}.{label}"] = value.reshape(shape).contiguous()
            tensors[f"{name}.step"] = torch.tensor(float(state["step"]))
        groups.append({"params": list(shapes), **{k: v for k, v in record[C.GROUPS_KEY][g][C.HYPERPARAMS_KEY].items()
                                                  if k != "params"}})
    return tensors, {"optimizer_class": record[C.OPTIMIZER_CLASS_KEY], "state_names": list(names),
                     "param_groups": groups}


def _untie(weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory: give each name its own copy."""
    seen, out = set(), {}
    for name, tensor in weights.items():
        key = (tensor.data_ptr(), tensor.numel())
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out
