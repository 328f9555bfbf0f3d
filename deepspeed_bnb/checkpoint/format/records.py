"""Builds the per-rank optimizer-state record (see constants.py) and loads records at any DP size, checking first.

Loading validates every record it will read (format, optimizer class, model, precision, key classes, layout) before
it changes anything, then fills the new partition with the block-aligned runs of reshard.plan: at the saving DP size
the plan is the identity, at another it moves parameter pieces between ranks. Either way it is a copy: lossless.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.reshard import Run, copy_runs, plan
from deepspeed_bnb.optim.state_classes import FP32_PREFIX, StateClass, zeros_like_partitioned
from deepspeed_bnb.state_layout import GroupLayout, layout_from_dict


@dataclass
class GroupRecord:
    """What one rank holds for one param group: the live view a record is built from and loaded into."""

    hyperparams: dict  # the param group dict of the bnb optimizer (has 'params', which is never saved)
    layout: GroupLayout  # block-aligned flat layout of the group
    param_names: List[str]  # model parameter names in flat order
    eight_bit: List[bool]  # per parameter in flat order: 8-bit state (True) or fp32 state (False)
    key_classes: Dict[str, StateClass]  # flat-state key -> class (the same on every rank)
    state: dict  # the flat state of this rank's partition (live tensors, loaded in place)
    master: Optional[torch.Tensor] = None  # this rank's fp32 master-weight partition (loaded in place)
    master_layout: Optional[object] = None  # layout of the master weights as saved, when not `layout` (ZeRO-3)


def empty_group_record(layout: GroupLayout, rank: int, param_names: Sequence[str], eight_bit: Sequence[bool],
                       key_classes: Dict[str, StateClass], templates: dict, hyperparams: dict) -> GroupRecord:
    """A zero GroupRecord for `rank` of `layout`, its tensors shaped like `templates` (rows, dtype; whole tensors and
    scalars are copied): what offline writers fill before build_record."""
    fp32_numel = layout.fp32_numel(rank, eight_bit)
    state = {}
    for key, cls in key_classes.items():
        value = templates[key]
        length = fp32_numel if key.startswith(FP32_PREFIX) else layout.partition_size
        if cls in (StateClass.ELEMENT, StateClass.BLOCK):
            state[key] = zeros_like_partitioned(cls, value, length, device="cpu")
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
    return GroupRecord(hyperparams={**{k: v for k, v in hyperparams.items() if k != "params"}, "params": []},
                       layout=layout, param_names=list(param_names), eight_bit=list(eight_bit),
                       key_classes=dict(key_classes), state=state,
                       master=torch.zeros(layout.partition_size, dtype=torch.float32))


def build_record(optimizer_class: str, optimizer_name: str, dp_rank: int, groups: Sequence[GroupRecord],
                 master_entry: Optional[str] = None) -> dict:
    """The record of one rank. Whole tensors (maps) are the same everywhere and stored once, by rank 0.
    `master_entry`: the ZeRO state-dict entry holding the master weights when it is not DeepSpeed's stage-1/2 one."""
    record = {
        C.FORMAT_KEY: C.FORMAT_VERSION,
        C.OPTIMIZER_CLASS_KEY: optimizer_class,
        C.OPTIMIZER_NAME_KEY: optimizer_name,
        C.DP_RANK_KEY: dp_rank,
        C.GROUPS_KEY: [{
            C.HYPERPARAMS_KEY: {k: v for k, v in g.hyperparams.items() if k != "params"},
            C.LAYOUT_KEY: g.layout.to_dict(),
            C.PARAM_NAMES_KEY: list(g.param_names),
            C.EIGHT_BIT_KEY: list(g.eight_bit),
            C.KEY_CLASSES_KEY: {k: cls.value for k, cls in g.key_classes.items()},
            C.STATE_KEY: {k: v for k, v in g.state.items()
                          if k in g.key_classes and (dp_rank == 0 or g.key_classes[k] != StateClass.WHOLE)},
            **({C.MASTER_LAYOUT_KEY: g.master_layout.to_dict()} if g.master_layout is not None else {}),
        } for g in groups],
    }
    if master_entry is not None:
        record[C.MASTER_ENTRY_KEY] = master_entry
    return record


def is_record(value) -> bool:
    return isinstance(value, dict) and C.FORMAT_KEY in value


def check_record(record, source: str, optimizer_class: Optional[str] = None) -> None:
    """Refuse anything that is not a well-formed record this version can read (written by `optimizer_class`, when
    given): every count and name in it checked before a reader relies on one."""
    if not is_record(record):
        raise CheckpointMismatchError(
            f"{source} holds no deepspeed_bnb optimizer state (it was written by stock DeepSpeed or another tool). "
            f"Its bitsandbytes state is laid out per ZeRO partition, not per parameter, and cannot be loaded safely. "
            f"Load with load_optimizer_states=False (weights only), or re-save it with deepspeed_bnb.")
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
            f"with the min_8bit_size / optim_bits used when saving.")
    classes = {k: v.value for k, v in live.key_classes.items()}
    if saved[C.KEY_CLASSES_KEY] != classes:
        raise CheckpointMismatchError(
            f"{where}: optimizer-state keys differ: checkpoint {saved[C.KEY_CLASSES_KEY]}, engine {classes}.")
    return layout


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointMismatchError(message)


def _check_tensor(value, shape, dtype, where: str) -> None:
    _expect(torch.is_tensor(value) and tuple(value.shape) == tuple(shape) and value.dtype == dtype,
            f"{where} is {tuple(value.shape) if torch.is_tensor(value) else type(value).__name__} "
            f"{getattr(value, 'dtype', '')} in the checkpoint; expected {tuple(shape)} {dtype}. The file is damaged "
            f"or was not written by this layout.")


def load_records(source, groups: Sequence[GroupRecord], new_rank: int, optimizer_class: str,
                 optimizer_states: bool, master_weights: bool, validate_only: bool = False) -> None:
    """Load this rank's share of a checkpoint written at DP size `source.dp` (any DP, stage 1, 2 or 3; same model
    and optimizer).

    `source` gives each old rank's optimizer_state_dict (sources.py); `master_weights`: also load the old ranks' fp32
    master-weight partitions (False: keep the live ones). Nothing changes unless everything fits.
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
    old_layouts = [_check_group(saved, live, f"{source.name(0)}, param group {g}")
                   for g, (saved, live) in enumerate(zip(first[C.GROUPS_KEY], groups))]
    for g, layout in enumerate(old_layouts):
        _expect(layout.dp == source.dp, f"{source.name(0)}, param group {g}: written for {layout.dp} ranks, but the "
                                        f"checkpoint has {source.dp} rank files.")
    runs = [plan(old, live.layout, live.eight_bit, new_rank) for old, live in zip(old_layouts, groups)]
    master_layouts = [layout_from_dict(saved.get(C.MASTER_LAYOUT_KEY, saved[C.LAYOUT_KEY]))
                      for saved in first[C.GROUPS_KEY]]
    master_runs = [plan(old, live.layout, live.eight_bit, new_rank) for old, live in zip(master_layouts, groups)]
    masters = {}

    def master(rank, g):
        if (rank, g) not in masters:
            masters[(rank, g)] = saved_master(source.state(rank), record(rank), g, master_layouts)
        return masters[(rank, g)]

    needed = sorted({0} | {run.src_rank for group_runs in runs + (master_runs if master_weights else [])
                           for run in group_runs})

    # -- validate every input before changing anything --
    for rank in needed:
        rec = record(rank)
        for g, (saved, live, old) in enumerate(zip(rec[C.GROUPS_KEY], groups, old_layouts)):
            where = f"{source.name(rank)}, param group {g}"
            _expect(layout_from_dict(saved[C.LAYOUT_KEY]) == old and
                    saved[C.KEY_CLASSES_KEY] == first[C.GROUPS_KEY][g][C.KEY_CLASSES_KEY],
                    f"{where}: layout or state keys differ from rank 0's file; the checkpoint mixes files of "
                    f"different runs.")
            if optimizer_states:
                _check_saved_state(saved[C.STATE_KEY], live, old, rank, where)
            if master_weights:
                m = master_layouts[g]
                _check_tensor(master(rank, g), (m.partition_size - m.tail_padding(rank),), live.master.dtype,
                              f"{source.name(rank)}: fp32 master weights of param group {g}")
    if validate_only:
        return

    # -- apply --
    for g, (live, group_runs) in enumerate(zip(groups, runs)):
        if optimizer_states:
            _apply_group(g, live, group_runs, record)
        if master_weights:
            live.master.zero_()
            copy_runs(live.master, lambda rank, g=g: master(rank, g), master_runs[g], StateClass.ELEMENT)


def check_saved_records(source, optimizer_class: Optional[str] = None) -> None:
    """Every rank file of `source` holds a well-formed record of rank 0's layout, key classes and precisions, with
    exactly the tensors and master weights that layout gives each rank: what an offline reader checks before it
    allocates anything from the layout (the tensors lie in the files, so the layout is bounded by their bytes).
    The checks are load_records' own, against templates on the meta device (no memory)."""
    first = source.state(0).get(C.BASE_OPTIMIZER_STATE_KEY) if isinstance(source.state(0), dict) else None
    check_record(first, source.name(0), optimizer_class)
    templates = []
    for saved in first[C.GROUPS_KEY]:
        layout = layout_from_dict(saved[C.LAYOUT_KEY])
        classes = {k: StateClass(v) for k, v in saved[C.KEY_CLASSES_KEY].items()}
        state = {}
        for key, cls in classes.items():
            value = saved[C.STATE_KEY].get(key)
            if cls in (StateClass.ELEMENT, StateClass.BLOCK, StateClass.WHOLE) and not torch.is_tensor(value):
                raise CheckpointMismatchError(f"{source.name(0)}: state {key!r} ({cls.value}) is "
                                              f"{type(value).__name__}, not a tensor; the record is malformed.")
            state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta") if torch.is_tensor(value) \
                else value
        templates.append(GroupRecord(hyperparams={}, layout=layout, param_names=list(saved[C.PARAM_NAMES_KEY]),
                                     eight_bit=list(saved[C.EIGHT_BIT_KEY]), key_classes=classes, state=state,
                                     master=torch.empty(0, dtype=torch.float32, device="meta")))
    for rank in range(source.dp):  # each call checks rank 0's record and this rank's (the ones it would read)
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


def _check_saved_state(saved: dict, live: GroupRecord, old: GroupLayout, rank: int, where: str) -> None:
    fp32_numel = old.fp32_numel(rank, live.eight_bit)
    for key, cls in live.key_classes.items():
        value, target = saved.get(key), live.state[key]
        if cls == StateClass.WHOLE:
            if rank == 0:
                _check_tensor(value, target.shape, target.dtype, f"{where}: state {key!r}")
            continue
        _expect(key in saved, f"{where}: state {key!r} is missing.")
        if cls == StateClass.SCALAR:
            _expect(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                    f"{where}: state {key!r} should be a number, not {str(value)[:80]}.")
            continue
        length = fp32_numel if key.startswith(FP32_PREFIX) else old.partition_size
        if cls == StateClass.BLOCK:
            length = length // old.block
        _check_tensor(value, (*target.shape[:-1], length), target.dtype, f"{where}: state {key!r}")


def _apply_group(g: int, live: GroupRecord, runs: Sequence[Run], record) -> None:
    first = record(0)[C.GROUPS_KEY][g]
    for key, cls in live.key_classes.items():
        if cls == StateClass.SCALAR:
            live.state[key] = first[C.STATE_KEY][key]
        elif cls == StateClass.WHOLE:
            live.state[key].copy_(first[C.STATE_KEY][key])
        else:
            fp32_space = key.startswith(FP32_PREFIX)
            mine = [run for run in runs if live.eight_bit[run.slot] != fp32_space]
            live.state[key].zero_()
            copy_runs(live.state[key], lambda rank: record(rank)[C.GROUPS_KEY][g][C.STATE_KEY][key], mine, cls,
                      fp32_space)
    params = live.hyperparams["params"]
    live.hyperparams.clear()
    live.hyperparams.update(first[C.HYPERPARAMS_KEY])
    live.hyperparams["params"] = params
