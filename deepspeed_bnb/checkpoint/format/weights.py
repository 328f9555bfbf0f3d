"""A checkpoint's per-parameter values in fp32: the consolidated weights (what DeepSpeed's zero_to_fp32 gives) and a
parameter's optimizer-state rows with 8-bit codes dequantized. Read through SavedCheckpoint (safe loader, manifest).

zero_to_fp32 unpickles every file in full and globs the tag for files (listed in a manifest or not); this module is
what deepspeed_bnb reads instead, for its own checkpoints (the records' master weights) and stock DeepSpeed's (ZeRO-1/2:
the master partitions cut by `param_slice_mappings`; ZeRO-3: `fp32_flat_groups` in slices of ceil(numel / dp),
stock_zero3.py), with the frozen parameters ZeRO-2/3 saves record (ZeRO-3's slices joined from every rank's model
states as zero_to_fp32 joins them), and the module's other tensors: from the model states' `module`, or, for a
pipeline engine, which saves its module in one file per layer, from those files.
"""

import os
import re
from collections import OrderedDict
from typing import Collection, Dict, List, Optional

import torch
from deepspeed.checkpoint.constants import PARAM_SLICE_MAPPINGS

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format import stock_zero3
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.model_parallel import TIED
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint, check_model_states
from deepspeed_bnb.checkpoint.format.records import saved_place
from deepspeed_bnb.checkpoint.format.safe_load import load_file
from deepspeed_bnb.ops.reference import dequantize_blockwise

FROZEN_SHAPES, FROZEN_FRAGMENTS = "frozen_param_shapes", "frozen_param_fragments"  # DeepSpeed's ZeRO-2/3 entries


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


# DeepSpeed's MoE saves: one file per expert of every MoE layer, its tensors under their global names
EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_mp_rank_(\d\d+)_model_states\.pt$")


def consolidated_weights(ckpt: SavedCheckpoint) -> Dict[str, torch.Tensor]:
    """fp32 weights of every trained parameter, plus the model's other tensors (buffers, frozen) as saved."""
    states = ckpt.model_states
    weights = module_tensors(ckpt)
    weights.update(frozen_weights(ckpt, module=weights))
    weights.update(trained_weights(ckpt))
    weights.update({name: tensor for name, tensor in expert_weights(ckpt).items() if name not in weights})
    for name, source in states.get("shared_params", {}).items():
        weights[name] = weights[source]  # tied weights: the same tensor under both names
    return weights


def expert_weights(ckpt: SavedCheckpoint) -> Dict[str, torch.Tensor]:
    """Every tensor of the tag's MoE expert files (this model-parallel rank's). What the optimizer does not train of an
    expert is only there: DeepSpeed writes `frozen_param_*` from DP rank 0 alone, under its local expert names, so the
    frozen parts of the other expert-parallel ranks' experts are in no other file."""
    out = {}
    for name in ckpt.other_files():
        match = EXPERT_FILE.match(os.path.basename(name))
        if match is None or int(match.group(1)) != getattr(ckpt, "mp_rank", 0):
            continue
        out.update(_tensor_map(os.path.join(ckpt.tag_dir, name), "an expert's weights"))
    return out


def _tensor_map(path: str, what: str) -> Dict[str, torch.Tensor]:
    """The file at `path`, which must hold a map of names to tensors (`what`)."""
    held = load_file(path)
    if not isinstance(held, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in held.items()):
        raise CheckpointMismatchError(f"{path} is not a map of names to tensors ({what}); the file is malformed.")
    return held


def trained_weights(ckpt: SavedCheckpoint) -> Dict[str, torch.Tensor]:
    """name -> fp32 weights (the parameter's shape) of every parameter the optimizer trained."""
    if not ckpt.is_deepspeed_bnb and ckpt.zero_stage == 3:
        return stock_zero3.fp32_weights(ckpt)
    weights = {}
    for g, shapes in enumerate(ckpt.param_shapes()):
        masters = ckpt.master_weights(g) if ckpt.is_deepspeed_bnb else stock_master_weights(ckpt, g)
        for (name, shape), master in zip(shapes.items(), masters):
            weights[name] = master.reshape(shape).clone()
    return weights


def stock_master_weights(ckpt: SavedCheckpoint, g: int) -> List[torch.Tensor]:
    """Each parameter of param group g of a stock ZeRO-1/2 checkpoint, flattened: its pieces cut from every rank's
    master partition by DeepSpeed's `param_slice_mappings`, joined in rank order."""
    pieces: Dict[str, list] = OrderedDict((name, []) for name in ckpt.param_shapes()[g])
    for rank in range(ckpt.dp):
        state, where = ckpt.optimizer_state(rank), ckpt.source.name(rank)
        try:
            master, mappings = state[C.MASTER_WEIGHTS_KEY][g], state[PARAM_SLICE_MAPPINGS][g]
            for name, address in mappings.items():
                pieces[name].append(master.narrow(0, address.start, address.numel))
        except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as exc:
            raise CheckpointMismatchError(f"{where}: the master weights of param group {g} cannot be cut by its "
                                          f"'{PARAM_SLICE_MAPPINGS}' ({type(exc).__name__}: {exc}); the file is "
                                          f"malformed.") from None
    out = []
    for (name, shape), parts in zip(ckpt.param_shapes()[g].items(), pieces.values()):
        joined = torch.cat(parts) if parts else torch.empty(0)
        if joined.numel() != torch.Size(shape).numel():
            raise CheckpointMismatchError(f"{ckpt.tag_dir}: the rank files hold {joined.numel()} master-weight "
                                          f"elements of {name}, its shape {tuple(shape)} has "
                                          f"{torch.Size(shape).numel()}; the files are of different runs.")
        out.append(joined)
    return out


def zero3_slice(flat: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """What ZeRO-3 rank `rank` holds of a flattened parameter whose slices are `size` elements: elements
    [rank * size, (rank + 1) * size), zero-padded past its end (frozen_weights joins them back)."""
    piece = flat.new_zeros(size)
    real = flat[rank * size:(rank + 1) * size]
    piece[:real.numel()] = real
    return piece


def frozen_weights(ckpt, trained: Optional[Dict[str, tuple]] = None, buffers: Optional[Collection[str]] = None,
                   module: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The frozen parameters' full weights as the tag holds them, in their saved dtype; empty where it holds none.

    DeepSpeed's ZeRO-2 and ZeRO-3 saves record parameters the optimizer does not own (`frozen_param_shapes`, and
    `frozen_param_fragments`: what each rank holds of them). A ZeRO-2 rank holds them whole, in the one model-states
    file; a ZeRO-3 rank holds its slice of ceil(numel / dp) elements (zero-padded at the end), in its own
    `zero_pp_rank_<r>` model states. Per parameter: rank 0's fragment where it covers the parameter (a ZeRO-2 tag, or
    one ZeRO-3 rank), else the slices of ranks 0, 1, ... joined as zero_to_fp32 joins them.

    A ZeRO-1 save (a pipeline's too) records neither (None): its frozen parameters are the module's other tensors
    (`module`, by default module_tensors): neither `trained` (name -> shape) nor `buffers` (by default what this
    rank's model states name; a reader joining several pipeline stages passes every stage's) nor a tied weight's
    second name."""
    shapes = ckpt.model_states.get(FROZEN_SHAPES)
    if not shapes:
        known = {**_known(ckpt, trained, buffers),
                 **{name: None for name in ckpt.model_states.get("shared_params") or {}}}
        module = module_tensors(ckpt, 0, known) if module is None else module
        return {name: tensor for name, tensor in module.items()  # (a module's get_extra_state is no parameter)
                if name not in known and torch.is_tensor(tensor) and tensor.numel() > 0
                and name.rpartition(".")[2] != "_extra_state"}
    first = getattr(ckpt, "model_states_path", ckpt.tag_dir)  # a universal checkpoint's has no such property
    if not isinstance(shapes, dict):
        raise CheckpointMismatchError(f"{first}: '{FROZEN_SHAPES}' is not a map of names to shapes.")
    ranks = [(first, ckpt.model_states)]  # (path, model states) of ranks 0, 1, ... read so far

    def fragments(rank: int) -> dict:
        while len(ranks) <= rank:
            path = os.path.join(ckpt.tag_dir, C.STAGE3_MODEL_STATES.format(len(ranks)))
            ranks.append((path, check_model_states(load_file(path), path)))
        path, states = ranks[rank]
        found = states.get(FROZEN_FRAGMENTS)
        if not isinstance(found, dict) or set(found) != set(shapes) or \
                not all(torch.is_tensor(found[name]) for name in shapes):
            raise CheckpointMismatchError(f"{path}: '{FROZEN_FRAGMENTS}' does not hold this rank's share of every "
                                          f"frozen parameter {sorted(shapes)[:5]}; the files are of different runs.")
        return found

    weights = {}
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        parts, held = [], 0
        while held < numel or not parts:
            part = fragments(len(parts))[name].reshape(-1)
            if part.numel() == 0 and numel > 0:
                raise CheckpointMismatchError(f"{ckpt.tag_dir}: the slices of frozen parameter {name} hold fewer than "
                                              f"its {numel} elements; the files are of different runs.")
            parts.append(part)
            held += part.numel()
        weights[name] = torch.cat(parts).narrow(0, 0, numel).reshape(shape).clone()
    return weights


# A PipelineModule's save: one file per layer, `layer_<index>[-<rank repr>]-model_states.pt`, holding that layer's
# state_dict under its own names (DeepSpeed's PipelineModule.ckpt_layer_path: the rank repr names the tensor-parallel
# coordinate, `model_<r>`, where the topology has one)
LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")


def pipeline_layers(ckpt, tp_rank: int = 0, known: Optional[Dict[str, Optional[tuple]]] = None) \
        -> Dict[str, torch.Tensor]:
    """Every tensor of the tag's pipeline layer files (of tensor-parallel rank `tp_rank`) under the module's names: a
    pipeline engine saves its module there, every stage's layers side by side, and `module` None in the model states.
    Layer i's tensors are `<name of layer i>.<name>`, the layer's name as our record holds it (recorded_layers). A
    pipeline saved by stock DeepSpeed or before the names were recorded: `<i>.<name>`, except where none of those is
    `known` (name -> shape or None: trained parameters, buffers) but the file holds every known tensor of one tied
    module (`tied_modules.<key>.<name>`), in its shape: then they are that module's (a tied module with no tensor
    known, wholly frozen, cannot be told from layer i then)."""
    recorded = recorded_layers(ckpt)
    known = known or {}
    tied: Dict[str, Dict[str, Optional[tuple]]] = {}
    for name, shape in known.items():
        if name.startswith(TIED):
            key, _, local = name[len(TIED):].partition(".")
            tied.setdefault(key, {})[local] = shape
    out = {}
    for name in ckpt.other_files():
        match = LAYER_FILE.match(os.path.basename(name))
        if match is None or int(match.group(2) or 0) != tp_rank:
            continue
        held = _tensor_map(os.path.join(ckpt.tag_dir, name), "a pipeline layer's weights")
        index = int(match.group(1))
        if recorded:
            if index not in recorded:
                raise CheckpointMismatchError(f"{ckpt.tag_dir}: {name} is a layer file the save's record does not "
                                              f"name (its pipeline has layer files {sorted(recorded)}); the files "
                                              f"are of different runs.")
            prefix = recorded[index] + "."
        else:
            prefix = f"{index}."
            owners = [key for key, members in tied.items()
                      if all(local in held and (shape is None or tuple(held[local].shape) == tuple(shape))
                             for local, shape in members.items())]
            if not any(prefix + local in known for local in held) and len(owners) == 1:
                prefix = f"{TIED}{owners[0]}."
        out.update({prefix + local: tensor for local, tensor in held.items()})
    return out


def recorded_layers(ckpt) -> Dict[int, str]:
    """A pipeline's layer file index -> its module name, as the first rank's record holds it (ModelParallelPlace
    .layers); empty where none is recorded (stock DeepSpeed, an older deepspeed_bnb, a checkpoint of another tool)."""
    if not getattr(ckpt, "is_deepspeed_bnb", False) or not hasattr(ckpt, "record"):
        return {}
    place = saved_place(ckpt.record(0), ckpt.source.name(0))
    return place.layers if place is not None else {}


def _trained_shapes(ckpt) -> Dict[str, tuple]:
    return {name: tuple(shape) for group in ckpt.param_shapes() for name, shape in group.items()}


def _known(ckpt, trained: Optional[Dict[str, tuple]] = None,
           buffers: Optional[Collection[str]] = None) -> Dict[str, Optional[tuple]]:
    """name -> shape of the parameters the optimizer trains (`trained`, by default the checkpoint's) and, shape
    unknown, the buffers (`buffers`, by default the ones the model states name)."""
    buffers = ckpt.model_states.get("buffer_names") or [] if buffers is None else buffers
    return {**{name: None for name in buffers}, **(_trained_shapes(ckpt) if trained is None else trained)}


def module_tensors(ckpt, tp_rank: int = 0, known: Optional[Dict[str, Optional[tuple]]] = None) \
        -> Dict[str, torch.Tensor]:
    """The module's tensors as the tag's model states hold them (`module`), or a pipeline's from its layer files
    (pipeline_layers; `known` by default this rank's trained parameters and buffers)."""
    module = ckpt.model_states.get("module")
    if module is not None:
        return dict(module)
    return pipeline_layers(ckpt, tp_rank, _known(ckpt) if known is None else known)


def buffer_weights(ckpt, names: Optional[Collection[str]] = None,
                   module: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The persistent buffers `names` (by default the ones the model states name: `buffer_names`) as saved (in
    `module`, by default module_tensors)."""
    names = ckpt.model_states.get("buffer_names") or [] if names is None else names
    if not names:
        return {}
    if module is None:
        module = module_tensors(ckpt, 0, {**_known(ckpt), **{name: None for name in names}})
    return {name: module[name] for name in names if name in module}
