"""Builds the per-rank optimizer-state record (see constants.py) and loads records at any DP size, checking first.

Loading validates every record it will read (format, optimizer class, model, precision, key classes, layout) before
it changes anything, then fills the new partition with the block-aligned runs of reshard.plan: at the saving DP size
the plan is the identity, at another it moves parameter pieces between ranks. Either way it is a copy: lossless.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.experts import ExpertPlacement, placement_from_dict
from deepspeed_bnb.checkpoint.format.model_parallel import (ALONE, ModelParallelPlace, layers_from_dict, layers_to_dict,
                                                           place_from_dict)
from deepspeed_bnb.checkpoint.format.reshard import Run, copy_runs, plan
from deepspeed_bnb.ops import compensated
from deepspeed_bnb.optim import master_weights
from deepspeed_bnb.optim.flat_state import FlatKeys, in_fp32_space
from deepspeed_bnb.optim.state_classes import StateClass
from deepspeed_bnb.state_layout import GroupLayout, layout_from_dict


@dataclass
class GroupRecord:
    """What one rank holds for one param group: the live view a record is built from and loaded into."""

    hyperparams: dict  # the param group dict of the bnb optimizer (has 'params', which is never saved)
    layout: GroupLayout  # block-aligned flat layout of the group
    param_names: List[str]  # model parameter names in flat order
    eight_bit: List[bool]  # per parameter in flat order: 8-bit state (True) or fp32 state (False)
    key_classes: FlatKeys  # flat-state key -> class (the same on every rank)
    state: dict  # the flat state of this rank's partition (live tensors, loaded in place)
    master: Optional[torch.Tensor] = None  # this rank's master-weight partition, fp32 or bf16 (loaded in place)
    master_error: Optional[torch.Tensor] = None  # its int8 error term where the master weights are "bf16+8"
    master_layout: Optional[object] = None  # layout of the master weights as saved, when not `layout` (ZeRO-3)
    expert: Optional[ExpertPlacement] = None  # an expert group's placement (DeepSpeed MoE); param_names are global

    def __post_init__(self):
        self.key_classes = FlatKeys.of(self.key_classes)  # a plain key -> class mapping is accepted


def empty_group_record(layout: GroupLayout, rank: int, param_names: Sequence[str], eight_bit: Sequence[bool],
                       key_classes: Dict[str, StateClass], templates: dict, hyperparams: dict) -> GroupRecord:
    """A zero GroupRecord for `rank` of `layout`, its tensors shaped like `templates` (rows, dtype; whole tensors and
    scalars are copied): what offline writers fill before build_record."""
    keys = FlatKeys.of(key_classes)
    state = keys.zeros(templates, layout.partition_size, layout.fp32_numel(rank, eight_bit))
    return GroupRecord(hyperparams={**{k: v for k, v in hyperparams.items() if k != "params"}, "params": []},
                       layout=layout, param_names=list(param_names), eight_bit=list(eight_bit),
                       key_classes=keys, state=state,
                       master=torch.zeros(layout.partition_size, dtype=torch.float32))


def build_record(optimizer_class: str, optimizer_name: str, dp_rank: int, groups: Sequence[GroupRecord],
                 master_entry: Optional[str] = None, master_mode: str = master_weights.FP32,
                 model_parallel: ModelParallelPlace = ALONE) -> dict:
    """The record of one rank. Whole tensors (maps) are the same everywhere and stored once, by rank 0.
    `master_entry`: the ZeRO state-dict entry holding the master weights when it is not DeepSpeed's stage-1/2 one;
    `master_mode`: the run's master weights (optim/master_weights.py), which the saved master tensors follow
    (`saved_master_dtype`); `model_parallel`: the rank's place in a tensor- or pipeline-parallel layout."""
    record = {
        C.FORMAT_KEY: C.FORMAT_VERSION,
        C.MASTER_MODE_KEY: master_mode,
        C.OPTIMIZER_CLASS_KEY: optimizer_class,
        C.OPTIMIZER_NAME_KEY: optimizer_name,
        C.DP_RANK_KEY: dp_rank,
        C.MODEL_PARALLEL_KEY: model_parallel.to_dict(),
        **({C.PIPELINE_LAYERS_KEY: layers_to_dict(model_parallel.layers)} if model_parallel.layers else {}),
        C.GROUPS_KEY: [{
            C.HYPERPARAMS_KEY: {k: v for k, v in g.hyperparams.items() if k != "params"},
            C.LAYOUT_KEY: g.layout.to_dict(),
            C.PARAM_NAMES_KEY: list(g.param_names),
            C.EIGHT_BIT_KEY: list(g.eight_bit),
            C.KEY_CLASSES_KEY: {k: cls.value for k, cls in g.key_classes.items()},
            C.STATE_KEY: g.key_classes.saved_by(g.state, dp_rank),  # a FlatKeys (GroupRecord makes it one)
            **({C.MASTER_LAYOUT_KEY: g.master_layout.to_dict()} if g.master_layout is not None else {}),
            **({C.EXPERTS_KEY: g.expert.to_dict()} if g.expert is not None else {}),
        } for g in groups],
    }
    if master_entry is not None:
        record[C.MASTER_ENTRY_KEY] = master_entry
    return record


def is_record(value) -> bool:
    return isinstance(value, dict) and C.FORMAT_KEY in value


def saved_master_mode(record: dict) -> str:
    """The master weights of the run that wrote a (checked) record: "fp32" before format 3."""
    return record.get(C.MASTER_MODE_KEY, master_weights.FP32)


def saved_place(record: dict, source: str) -> Optional[ModelParallelPlace]:
    """The model-parallel place of the rank that wrote a record (with a pipeline's layer names where recorded),
    checked; None where the record predates it."""
    data = record.get(C.MODEL_PARALLEL_KEY)
    if data is None:
        return None
    place = place_from_dict(data, source)
    layers = record.get(C.PIPELINE_LAYERS_KEY)
    return place if layers is None else dataclasses.replace(place, layers=layers_from_dict(layers, source))


def saved_master_dtype(record: dict) -> torch.dtype:
    """The dtype of a record's saved master weights: bf16 for "bf16" runs, fp32 otherwise ("bf16+8" saves its weights
    joined with their error terms, the fp32 values they stand for)."""
    return torch.bfloat16 if saved_master_mode(record) == master_weights.BF16 else torch.float32


def check_record(record, source: str, optimizer_class: Optional[str] = None) -> None:
    """Refuse anything that is not a well-formed record this version can read (written by `optimizer_class`, when
    given): every count and name in it checked before a reader relies on one."""
    if not is_record(record):
        raise CheckpointMismatchError(
            f"{source} holds no deepspeed_bnb optimizer state (it was written by stock DeepSpeed or another tool). "
            f"Its optimizer state is laid out per ZeRO partition, not per parameter, and is not loaded directly. "
            f"Convert it first: `deepspeed-bnb convert CHECKPOINT OUT --to 8bit --min-8bit-size N` (N: the run's "
            f"min_8bit_size) reads a stock run of torch's AdamW or of a bitsandbytes Adam (elastic_checkpoint: false) "
            f"and writes a checkpoint this engine loads at any DP size (an engine with zero_optimization."
            f"bnb_convert_stock_on_load: true does that itself at load_checkpoint); or load with "
            f"load_optimizer_states=False (weights only).")
    version = record[C.FORMAT_KEY]
    if version not in C.READABLE_FORMATS:
        raise CheckpointMismatchError(f"{source} uses deepspeed_bnb checkpoint format {version!r}; this version of "
                                      f"deepspeed_bnb reads formats {C.READABLE_FORMATS}. Upgrade deepspeed_bnb.")
    _check_structure(record, source)
    if optimizer_class is not None and record[C.OPTIMIZER_CLASS_KEY] != optimizer_class:
        raise CheckpointMismatchError(
            f"{source} was written by optimizer {record[C.OPTIMIZER_CLASS_KEY]}, but this engine uses "
            f"{optimizer_class}. Build the engine with the same optimizer class, or load with "
            f"load_optimizer_states=False.")


def _check_structure(record: dict, source: str) -> None:
    """The record's fields have the types and lengths the format gives them (the file is not trusted to)."""
    def malformed(where, what):
        return CheckpointMismatchError(f"{source}: {where} {what}; the record is malformed (damaged or crafted).")

    for key, kind in ((C.OPTIMIZER_CLASS_KEY, str), (C.OPTIMIZER_NAME_KEY, str), (C.DP_RANK_KEY, int),
                      (C.GROUPS_KEY, list)):
        if not isinstance(record.get(key), kind) or isinstance(record.get(key), bool):
            raise malformed(f"'{key}'", f"is {type(record.get(key)).__name__}, not {kind.__name__}")
    if saved_master_mode(record) not in master_weights.MODES:
        raise malformed(f"'{C.MASTER_MODE_KEY}'", f"is {saved_master_mode(record)!r}, not one of "
                                                  f"{master_weights.MODES}")
    saved_place(record, source)
    for g, group in enumerate(record[C.GROUPS_KEY]):
        where = f"param group {g}"
        if not isinstance(group, dict):
            raise malformed(where, f"is {type(group).__name__}, not a dict")
        layouts = []
        for key in (C.LAYOUT_KEY, C.MASTER_LAYOUT_KEY):
            if key in group or key == C.LAYOUT_KEY:
                try:
                    layouts.append(layout_from_dict(group.get(key)))
                except ValueError as exc:
                    raise malformed(f"{where}, '{key}'", f"is no layout ({exc})") from None
        if any((layout.numels, layout.dp) != (layouts[0].numels, layouts[0].dp) for layout in layouts):
            raise malformed(f"{where}, '{C.MASTER_LAYOUT_KEY}'", "has other parameters or ranks than its layout")
        numels = len(group[C.LAYOUT_KEY]["numels"])
        for key, kind in ((C.PARAM_NAMES_KEY, str), (C.EIGHT_BIT_KEY, bool)):
            value = group.get(key)
            if not isinstance(value, list) or len(value) != numels or not all(isinstance(v, kind) for v in value):
                raise malformed(f"{where}, '{key}'", f"is not a list of {numels} {kind.__name__} values (one per "
                                                     f"parameter of its layout)")
        classes, state = group.get(C.KEY_CLASSES_KEY), group.get(C.STATE_KEY)
        known = {cls.value for cls in StateClass}
        if not isinstance(classes, dict) or not all(isinstance(k, str) and v in known for k, v in classes.items()):
            raise malformed(f"{where}, '{C.KEY_CLASSES_KEY}'", f"is not a map of state keys to {sorted(known)}")
        if not isinstance(state, dict) or not set(state) <= set(classes) or \
                not isinstance(group.get(C.HYPERPARAMS_KEY), dict):
            raise malformed(where, f"has no '{C.HYPERPARAMS_KEY}' dict, or its '{C.STATE_KEY}' is not a dict of the "
                                   f"keys '{C.KEY_CLASSES_KEY}' lists")


def _first_difference(saved: Sequence, current: Sequence, names: Sequence[str]) -> str:
    for i, (a, b) in enumerate(zip(saved, current)):
        if a != b:
            return f"parameter #{i} ({names[i] if i < len(names) else '?'}): checkpoint {a!r}, engine {b!r}"
    return f"checkpoint has {len(saved)} parameters, engine has {len(current)}"


def _check_group(saved: dict, live: GroupRecord, where: str) -> GroupLayout:
    """The saved group is of the same model, precisions and state keys; returns its (saving) layout."""
    layout = layout_from_dict(saved[C.LAYOUT_KEY])
    if list(saved[C.PARAM_NAMES_KEY]) != list(live.param_names):
        detail = _first_difference(saved[C.PARAM_NAMES_KEY], live.param_names, live.param_names)
        raise CheckpointMismatchError(f"{where}: the checkpoint is of a different model ({detail}).")
    if layout.numels != live.layout.numels or layout.block != live.layout.block:
        raise CheckpointMismatchError(f"{where}: the checkpoint is of a different model "
                                      f"({_first_difference(layout.numels, live.layout.numels, live.param_names)} "
                                      f"elements).")
    if list(saved[C.EIGHT_BIT_KEY]) != list(live.eight_bit):
        raise CheckpointMismatchError(
            f"{where}: per-parameter state precision differs (8-bit vs fp32) — "
            f"{_first_difference(saved[C.EIGHT_BIT_KEY], live.eight_bit, live.param_names)}. Build the optimizer "
            f"with the min_8bit_size / optim_bits (and bnb overrides, such as HF Trainer's 32-bit embeddings) used "
            f"when saving; for a checkpoint written by `deepspeed-bnb convert`, convert again with this engine's "
            f"--min-8bit-size and --32bit-params NAME,...")
    _check_key_classes(saved, live, where)
    return layout


def _check_key_classes(saved: dict, live: GroupRecord, where: str) -> None:
    classes = {k: v.value for k, v in live.key_classes.items()}
    if saved[C.KEY_CLASSES_KEY] != classes:
        raise CheckpointMismatchError(
            f"{where}: optimizer-state keys differ: checkpoint {saved[C.KEY_CLASSES_KEY]}, engine {classes}.")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointMismatchError(message)


def _check_tensor(value, shape, dtype, where: str) -> None:
    _expect(torch.is_tensor(value) and tuple(value.shape) == tuple(shape) and value.dtype == dtype,
            f"{where} is {tuple(value.shape) if torch.is_tensor(value) else type(value).__name__} "
            f"{getattr(value, 'dtype', '')} in the checkpoint; expected {tuple(shape)} {dtype}. The file is damaged "
            f"or was not written by this layout.")


@dataclass(frozen=True)
class SavedPart:
    """Saved partitions of a param group's parameters: all of them, or one expert-parallel rank's experts."""

    files: Tuple[int, ...]  # the rank file holding each partition, in partition order
    layout: GroupLayout  # the layout they were written with
    master_layout: object  # the layout of their fp32 master weights (the same but at ZeRO-3: stock slices)
    names: Tuple[str, ...]  # parameter names in flat order (global expert names in an expert group)
    eight_bit: Tuple[bool, ...]  # per parameter in flat order: 8-bit state?
    ep_rank: Optional[int] = None  # the expert-parallel rank that held them (None: not an expert group)

    def partition(self, file: int) -> int:
        return self.files.index(file)


def saved_parts(record: Callable[[int], dict], g: int, dp: int, where: Callable[[int], str]) -> List[SavedPart]:
    """The saved parts of param group g of a checkpoint of `dp` rank files (`record(file)`: that file's checked
    record): one over every file, or one per expert-parallel rank over its expert-data-parallel files."""
    first = record(0)[C.GROUPS_KEY][g]
    if C.EXPERTS_KEY not in first:
        return [_part(first, tuple(range(dp)), None)]
    placement = placement_from_dict(first[C.EXPERTS_KEY], dp, f"{where(0)}, param group {g}")
    return [_part(record(files[0])[C.GROUPS_KEY][g], files, x) for x, files in enumerate(placement.files)]


def _part(saved: dict, files: Tuple[int, ...], ep_rank: Optional[int]) -> SavedPart:
    return SavedPart(files=files, layout=layout_from_dict(saved[C.LAYOUT_KEY]),
                     master_layout=layout_from_dict(saved.get(C.MASTER_LAYOUT_KEY, saved[C.LAYOUT_KEY])),
                     names=tuple(saved[C.PARAM_NAMES_KEY]), eight_bit=tuple(saved[C.EIGHT_BIT_KEY]), ep_rank=ep_rank)


def _slot_maps(parts: Sequence[SavedPart], live: GroupRecord, where: str) -> List[Dict[int, int]]:
    """Per saved part: live slot -> its slot there, for an expert group (every live parameter found once, with its
    size and precision; the checkpoint holding as many experts as the engine's expert-parallel ranks together)."""
    found = {name: (p, t) for p, part in enumerate(parts) for t, name in enumerate(part.names)}
    maps: List[Dict[int, int]] = [{} for _ in parts]
    for slot, name in enumerate(live.param_names):
        if name not in found:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint holds no state for {name} (its experts: {parts[0].names[0]}, ...). It is of "
                f"another model, or of a model with other experts.")
        p, t = found[name]
        if parts[p].layout.numels[t] != live.layout.numels[slot] or parts[p].eight_bit[t] != live.eight_bit[slot]:
            raise CheckpointMismatchError(
                f"{where}: {name} has {parts[p].layout.numels[t]} elements with "
                f"{'8-bit' if parts[p].eight_bit[t] else 'fp32'} state in the checkpoint, {live.layout.numels[slot]} "
                f"with {'8-bit' if live.eight_bit[slot] else 'fp32'} state in this engine.")
        maps[p][slot] = t
    held = len(live.param_names) * live.expert.ep_size
    if len(found) != held:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint holds {len(found)} expert parameters, this engine {held} "
            f"({len(live.param_names)} on each of {live.expert.ep_size} expert-parallel ranks): the models have "
            f"different numbers of experts. Build the MoE layers with the num_experts used when saving.")
    return maps


def _group_plans(parts: Sequence[SavedPart], live: GroupRecord, rank: int, where: str
                 ) -> Tuple[Tuple[Run, ...], Tuple[Run, ...]]:
    """The runs filling `rank`'s partition of `live` from the saved parts, of the state and of the fp32 master
    weights, with each run's src_rank the file index."""
    if live.expert is None:
        return tuple(plan(old, live.layout, live.eight_bit, rank)
                     for old in (parts[0].layout, parts[0].master_layout))
    state, master = [], []
    for part, slots in zip(parts, _slot_maps(parts, live, where)):
        for runs, old in ((state, part.layout), (master, part.master_layout)):
            runs += [dataclasses.replace(run, src_rank=part.files[run.src_rank])
                     for run in plan(old, live.layout, live.eight_bit, live.expert.edp_rank, slots, part.eight_bit)]
    return tuple(state), tuple(master)


def _check_expert_group(saved: dict, live: GroupRecord, where: str) -> None:
    # a record without placement holds all of a group's parameters: it fits an expert group spread over 1 rank
    if (C.EXPERTS_KEY in saved and live.expert is None) or \
            (C.EXPERTS_KEY not in saved and live.expert is not None and live.expert.ep_size > 1):
        what = "an expert group (DeepSpeed MoE)" if live.expert is not None else "not an expert group"
        raise CheckpointMismatchError(f"{where}: this engine's param group is {what}, the checkpoint's is not. Build "
                                      f"the param groups as when saving (split_params_into_different_moe_groups_for_"
                                      f"optimizer for MoE models).")
    _check_key_classes(saved, live, where)


def load_records(source, groups: Sequence[GroupRecord], new_rank: int, optimizer_class: str,
                 optimizer_states: bool, load_masters: bool, validate_only: bool = False) -> None:
    """Load this rank's share of a checkpoint written at DP size `source.dp` (any DP, stage 1, 2 or 3; same model
    and optimizer; an expert group at any expert-data-parallel size, and any expert-parallel size over the same
    experts).

    `source` gives each old rank's optimizer_state_dict (sources.py); `load_masters`: also load the old ranks'
    master-weight partitions (False: keep the live ones), in any master mode: converted to the live one, exactly
    where its bits allow (bf16 into fp32 or "bf16+8"; "bf16+8" into fp32), rounded otherwise (_load_master).
    Nothing changes unless everything fits.
    """
    records = {}

    def record(rank):
        if rank not in records:
            where = source.name(rank)
            value = source.state(rank)
            check_record(value.get(C.BASE_OPTIMIZER_STATE_KEY) if isinstance(value, dict) else None, where,
                         optimizer_class)
            rec = value[C.BASE_OPTIMIZER_STATE_KEY]
            _expect(rec[C.DP_RANK_KEY] == rank, f"{where} holds the state of rank {rec[C.DP_RANK_KEY]}, not {rank}.")
            _expect(len(rec[C.GROUPS_KEY]) == len(groups),
                    f"{where} has {len(rec[C.GROUPS_KEY])} param groups; this engine has {len(groups)}.")
            records[rank] = rec
        return records[rank]

    first = record(0)
    parts = []
    for g, (saved, live) in enumerate(zip(first[C.GROUPS_KEY], groups)):
        where = f"{source.name(0)}, param group {g}"
        if live.expert is None and C.EXPERTS_KEY not in saved:
            _check_group(saved, live, where)
        else:
            _check_expert_group(saved, live, where)
        parts.append(saved_parts(record, g, source.dp, source.name))
        for part in parts[g]:
            _expect(part.layout.dp == len(part.files),
                    f"{where}: written for {part.layout.dp} ranks, but the checkpoint has {len(part.files)} rank "
                    f"files{'' if part.ep_rank is None else f' for expert-parallel rank {part.ep_rank}'}.")
    plans = [_group_plans(p, live, new_rank, f"{source.name(0)}, param group {g}")
             for g, (p, live) in enumerate(zip(parts, groups))]
    runs, master_runs = [state for state, _ in plans], [master for _, master in plans]
    master_layouts = [p[0].master_layout for p in parts]  # ZeRO-3 (no expert groups) finds a group's by those before
    masters = {}

    def master(rank, g):
        if (rank, g) not in masters:
            masters[(rank, g)] = saved_master(source.state(rank), record(rank), g, master_layouts)
        return masters[(rank, g)]

    needed = sorted({0} | {run.src_rank for group_runs in runs + (master_runs if load_masters else [])
                           for run in group_runs})

    # -- validate every input before changing anything --
    for rank in needed:
        rec = record(rank)
        for g, (saved, live) in enumerate(zip(rec[C.GROUPS_KEY], groups)):
            where = f"{source.name(rank)}, param group {g}"
            part = next(p for p in parts[g] if rank in p.files)
            k = part.partition(rank)
            _expect(layout_from_dict(saved[C.LAYOUT_KEY]) == part.layout and
                    saved[C.KEY_CLASSES_KEY] == first[C.GROUPS_KEY][g][C.KEY_CLASSES_KEY] and
                    tuple(saved[C.PARAM_NAMES_KEY]) == part.names and
                    (C.EXPERTS_KEY in saved) == (part.ep_rank is not None) and
                    (part.ep_rank is None or _placed(saved, source.dp, where) == (part.ep_rank, k)),
                    f"{where}: layout, parameters or state keys differ from those of the other files of its "
                    f"partitions; the checkpoint mixes files of different runs.")
            if optimizer_states:
                _check_saved_state(saved[C.STATE_KEY], live, part, k, where, holds_whole=rank == 0)
            if load_masters:
                m = part.master_layout
                _check_tensor(master(rank, g), (m.partition_size - m.tail_padding(k),), saved_master_dtype(rec),
                              f"{source.name(rank)}: master weights of param group {g}")
    if validate_only:
        return

    # -- apply --
    for g, (live, group_runs) in enumerate(zip(groups, runs)):
        if optimizer_states:
            _apply_group(g, live, group_runs, record)
        if load_masters:
            _load_master(live, lambda rank, g=g: master(rank, g), master_runs[g])


def _load_master(live: GroupRecord, fetch: Callable[[int], torch.Tensor], runs: Sequence[Run]) -> None:
    """Fill a live master partition from the saved ones (fetch(rank)): copy_ widens bf16 exactly and rounds fp32 to
    nearest-even bf16; compensated master weights are filled in fp32 on the host and split into bf16 and error."""
    if live.master_error is None:
        live.master.zero_()
        copy_runs(live.master, fetch, runs, StateClass.ELEMENT)
        return
    wide = torch.zeros(live.master.shape, dtype=torch.float32)
    copy_runs(wide, fetch, runs, StateClass.ELEMENT)
    hi, lo = compensated.split(wide)
    live.master.copy_(hi)
    live.master_error.copy_(lo)


def _placed(saved: dict, dp: int, where: str) -> Tuple[int, int]:
    """(expert-parallel rank, partition) a file's record of an expert group says it holds."""
    placement = placement_from_dict(saved.get(C.EXPERTS_KEY), dp, where)
    return placement.ep_rank, placement.edp_rank


def check_saved_records(source, optimizer_class: Optional[str] = None) -> None:
    """Every rank file of `source` holds a well-formed record of rank 0's layout, key classes and precisions, with
    exactly the tensors and master weights that layout gives each rank: what an offline reader checks before it
    allocates anything from the layout (the tensors lie in the files, so the layout is bounded by their bytes).
    The checks are load_records' own, against templates on the meta device (no memory); an expert group's template
    is, for each file, the part of the experts that file holds."""
    first = source.state(0).get(C.BASE_OPTIMIZER_STATE_KEY) if isinstance(source.state(0), dict) else None
    check_record(first, source.name(0), optimizer_class)

    def record(rank):
        value = source.state(rank).get(C.BASE_OPTIMIZER_STATE_KEY) if isinstance(source.state(rank), dict) else None
        check_record(value, source.name(rank), first[C.OPTIMIZER_CLASS_KEY])
        _expect(len(value[C.GROUPS_KEY]) == len(first[C.GROUPS_KEY]),
                f"{source.name(rank)} has {len(value[C.GROUPS_KEY])} param groups; rank 0's file has "
                f"{len(first[C.GROUPS_KEY])}.")
        return value

    groups = []  # per group: key classes, meta-device state, saved parts
    for g, saved in enumerate(first[C.GROUPS_KEY]):
        classes = FlatKeys(saved[C.KEY_CLASSES_KEY])
        state = {}
        for key, cls in classes.items():
            value = saved[C.STATE_KEY].get(key)
            if cls in (StateClass.ELEMENT, StateClass.BLOCK, StateClass.WHOLE) and not torch.is_tensor(value):
                raise CheckpointMismatchError(f"{source.name(0)}: state {key!r} ({cls.value}) is "
                                              f"{type(value).__name__}, not a tensor; the record is malformed.")
            state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta") if torch.is_tensor(value) \
                else value
        groups.append((classes, state, saved_parts(record, g, source.dp, source.name)))
    for rank in range(source.dp):  # each call checks rank 0's record and this rank's (the ones it would read)
        templates = []
        for classes, state, parts in groups:
            part = next(p for p in parts if rank in p.files)
            expert = None if part.ep_rank is None else \
                ExpertPlacement("", len(parts), part.ep_rank, part.partition(rank), tuple(p.files for p in parts))
            templates.append(GroupRecord(hyperparams={}, layout=part.layout, param_names=list(part.names),
                                         eight_bit=list(part.eight_bit), key_classes=classes, state=state,
                                         master=torch.empty(0, dtype=torch.float32, device="meta"), expert=expert))
        load_records(source, templates, rank, first[C.OPTIMIZER_CLASS_KEY], True, True, validate_only=True)


def _flat_range(tensors: Sequence[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements [start, start + length) of the concatenation of `tensors`, copying only the pieces it spans."""
    pieces, offset = [], 0
    for tensor in tensors:
        lo, hi = max(start, offset), min(start + length, offset + tensor.numel())
        if lo < hi:
            pieces.append(tensor.reshape(-1).narrow(0, lo - offset, hi - lo))
        offset += tensor.numel()
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty(0)  # a short result fails the caller's shape check


def saved_master(zero_state: dict, record: dict, g: int, master_layouts: Sequence) -> torch.Tensor:
    """An old rank's fp32 master weights of param group `g`. Stage 1/2 keep them per group in DeepSpeed's
    MASTER_WEIGHTS_KEY; stage 3 in the entry the record names (DeepSpeed's fp32_flat_groups, one tensor per sub-group,
    stock ZeRO-3 slices so that DeepSpeed's zero_to_fp32 reads them), the groups one after another."""
    entry = record.get(C.MASTER_ENTRY_KEY, C.MASTER_WEIGHTS_KEY)
    tensors = zero_state.get(entry) if entry in (C.MASTER_WEIGHTS_KEY, C.FP32_FLAT_GROUPS_KEY) else None
    if not isinstance(tensors, list) or not all(torch.is_tensor(t) for t in tensors) or (
            entry == C.MASTER_WEIGHTS_KEY and len(tensors) <= g):
        return None  # the caller's shape check names the file
    if entry == C.MASTER_WEIGHTS_KEY:
        return tensors[g]
    start = sum(layout.partition_size for layout in master_layouts[:g])
    return _flat_range(tensors, start, master_layouts[g].partition_size)


def _check_saved_state(saved: dict, live: GroupRecord, part: SavedPart, rank: int, where: str,
                       holds_whole: bool) -> None:
    """The state of partition `rank` of `part` as saved has the keys, types and shapes the live state needs (and the
    whole tensors, which DP rank 0 saves for everyone, where `holds_whole`)."""
    old = part.layout
    fp32_numel = old.fp32_numel(rank, part.eight_bit)
    for key, cls in live.key_classes.items():
        value, target = saved.get(key), live.state[key]
        if cls == StateClass.WHOLE:
            if holds_whole:
                _check_tensor(value, target.shape, target.dtype, f"{where}: state {key!r}")
            continue
        _expect(key in saved, f"{where}: state {key!r} is missing.")
        if cls == StateClass.SCALAR:
            _expect(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                    f"{where}: state {key!r} should be a number, not {str(value)[:80]}.")
            continue
        length = live.key_classes.length(key, old.partition_size, fp32_numel, old.block)
        _check_tensor(value, (*target.shape[:-1], length), target.dtype, f"{where}: state {key!r}")


def _apply_group(g: int, live: GroupRecord, runs: Sequence[Run], record) -> None:
    first = record(0)[C.GROUPS_KEY][g]

    def copy_partitioned(key: str, cls: StateClass, tensor: torch.Tensor) -> None:
        fp32_space = in_fp32_space(key)
        mine = [run for run in runs if live.eight_bit[run.slot] != fp32_space]
        copy_runs(tensor, lambda rank: record(rank)[C.GROUPS_KEY][g][C.STATE_KEY][key], mine, cls, fp32_space)

    live.key_classes.load(live.state, first[C.STATE_KEY], copy_partitioned)
    # the group's structure stays the engine's: its parameters, and an expert group's name and mark (DeepSpeed finds
    # the expert-data-parallel group by the name, which changes with the expert-parallel size)
    kept = {k: live.hyperparams[k] for k in ("params", "name", "moe") if k in live.hyperparams} \
        if live.expert is not None else {"params": live.hyperparams["params"]}
    live.hyperparams.clear()
    live.hyperparams.update(first[C.HYPERPARAMS_KEY])
    live.hyperparams.update(kept)
