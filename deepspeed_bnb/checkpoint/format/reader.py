"""Opens a saved deepspeed_bnb checkpoint offline (no process group): manifest, model states, per-rank records.

`SavedCheckpoint(path)` accepts a checkpoint directory (it follows `latest`) or a tag directory. Rank files are
memory-mapped and read on demand; a rank's partition becomes per-parameter state with `param_states`, and a group
becomes a live-shaped GroupRecord for any rank of any DP size with `empty_group` (what reshape and convert fill).
"""

import os
import re
import warnings
from typing import Dict, List, Tuple

import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.constants import MODEL_STATES, MODEL_STATES_OF, STAGE3_MODEL_STATES_OF
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME, latest_tag, read_manifest, tag_files, verify
from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
from deepspeed_bnb.checkpoint.format.records import GroupRecord, SavedPart, check_record, check_saved_records, \
    empty_group_record, is_record, saved_master, saved_master_mode, saved_parts
from deepspeed_bnb.checkpoint.format.safe_load import TRUST_ENV, load_file, trusted
from deepspeed_bnb.checkpoint.format.sources import FileSource
from deepspeed_bnb.optim.param_state import ParamState
from deepspeed_bnb.optim.flat_state import FlatKeys
from deepspeed_bnb.state_layout import GroupLayout, ShardedLayout, layout_from_dict

_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d\d+)_optim_states\.pt$")
_STAGE3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d\d+)_model_states\.pt$")
_MODEL_RANKS = 1 << 16  # model-parallel ranks a reader believes a tag holds (file names are not trusted)
# Entries of a model-states file a reader relies on, and what each must be (a file is checked before use)
_MODEL_STATE_TYPES = {"module": dict, "param_shapes": list, "dp_world_size": int, "mp_world_size": int,
                      "global_steps": int, "skipped_steps": int, "global_samples": int, "buffer_names": list,
                      "shared_params": dict, "ds_config": dict, "ds_version": str}
_REQUIRED_MODEL_STATES = ("module", "dp_world_size")


def rank_files(tag_dir: str, mp_rank: int = 0) -> Tuple[bool, Dict[int, str]]:
    """(whether they carry bf16_ names, DP rank -> file name) of the ZeRO optimizer files in a tag directory (of
    model-parallel rank `mp_rank`; none: (False, {})); an error when files of an fp32 and a bf16 save lie side by
    side."""
    found: Dict[bool, Dict[int, str]] = {}
    for name in os.listdir(tag_dir):
        match = _RANK_FILE.match(name)
        if match and int(match.group(3)) == mp_rank:
            found.setdefault(bool(match.group(1)), {})[int(match.group(2))] = name
    if len(found) > 1:
        raise CheckpointMismatchError(f"{tag_dir} holds the optimizer files of a bf16 save (bf16_zero_pp_rank_*) "
                                      f"and of an fp32 one side by side: files of two checkpoints were mixed. Keep "
                                      f"one set, or load another tag.")
    bf16 = next(iter(found), False)
    return bf16, found.get(bf16, {})


def model_parallel_size(tag_dir: str) -> int:
    """How many model-parallel ranks (tensor-parallel ranks x pipeline stages) wrote optimizer files into a tag: the
    highest `mp_rank_XX` + 1 (1 for a data-parallel-only run)."""
    ranks = {int(m.group(3)) for m in map(_RANK_FILE.match, os.listdir(tag_dir)) if m}
    ranks = {r for r in ranks if r < _MODEL_RANKS}
    return max(ranks) + 1 if ranks else 1


def saved_dp(model_states: dict, tag_dir: str, where: str, mp_rank: int = 0) -> Tuple[int, bool, Dict[int, str]]:
    """(the DP size a checkpoint was written by, as its model states say, checked against the rank files the tag
    holds; whether those carry bf16_ names; rank -> file name): a count read from a file is believed only as far as
    the files bear it out."""
    bf16, files = rank_files(tag_dir, mp_rank)
    dp = model_states.get("dp_world_size", len(files))
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise CheckpointMismatchError(f"{where}: 'dp_world_size' is {dp!r}, not a number of ranks; the file is "
                                      f"malformed (damaged or crafted).")
    first_missing = next((rank for rank in range(len(files) + 1) if rank not in files), None)
    if first_missing is not None and first_missing < dp:
        name = C.RANK_FILE.format("bf16_" if bf16 else "", first_missing, mp_rank)
        raise CheckpointMismatchError(
            f"{os.path.join(tag_dir, name)} is missing: {where} says the checkpoint was written by {dp:,} "
            f"data-parallel ranks, and this file holds rank {first_missing}'s share (the tag holds {len(files)} "
            f"optimizer files). Restore the checkpoint from its source, or load another tag.")
    if len(files) != dp:
        raise CheckpointMismatchError(
            f"{tag_dir} holds optimizer files of {len(files)} ranks ({sorted(files)[:8]}...), but {where} says the "
            f"checkpoint was written by {dp}: files of another save were mixed in, or the model states were altered. "
            f"Restore the checkpoint from its source, or load another tag.")
    return dp, bf16, files


def check_model_states(states, path: str) -> dict:
    """`states`, a model-states file's contents, if the entries readers rely on have their types; else an error
    naming the file and the entry."""
    if not isinstance(states, dict):
        raise CheckpointMismatchError(f"{path} holds {type(states).__name__}, not DeepSpeed's model states (a dict).")
    for key in _REQUIRED_MODEL_STATES:
        if key not in states:
            raise CheckpointMismatchError(f"{path} has no '{key}' entry: it is not a DeepSpeed model-states file.")
    for key, kind in _MODEL_STATE_TYPES.items():
        value = states.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) or
                                  (kind is int and value < 0)):
            wanted = "an integer >= 0" if kind is int else f"a {kind.__name__}"
            raise CheckpointMismatchError(f"{path}: '{key}' is {str(value)[:100]}, not {wanted}; the file is "
                                          f"malformed (damaged or crafted).")
    module = states["module"] or {}  # None from a pipeline engine: its layers have files of their own
    if not all(isinstance(name, str) and torch.is_tensor(value) for name, value in module.items()):
        raise CheckpointMismatchError(f"{path}: 'module' is not a map of names to tensors; the file is malformed.")
    for shapes in states.get("param_shapes") or []:
        if not isinstance(shapes, dict) or not all(
                isinstance(name, str) and isinstance(shape, (tuple, list)) and
                all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
                for name, shape in shapes.items()):
            raise CheckpointMismatchError(f"{path}: 'param_shapes' is not a list of maps from names to shapes; the "
                                          f"file is malformed.")
    shared = states.get("shared_params") or {}
    if not all(isinstance(k, str) and isinstance(v, str) and v in module for k, v in shared.items()):
        raise CheckpointMismatchError(f"{path}: 'shared_params' names tied weights that 'module' does not hold; the "
                                      f"file is malformed.")
    return states


def model_states_name(tag_dir: str, mp_rank: int = 0) -> str:
    """The model-states file a loader reads first (of model-parallel rank `mp_rank`): stage 1/2's, or stage 3's of
    DP rank 0."""
    names = [MODEL_STATES_OF.format(mp_rank), STAGE3_MODEL_STATES_OF.format(0, mp_rank)]
    for name in names:
        if os.path.lexists(os.path.join(tag_dir, name)):
            return name
    return names[0]


def resolve_tag_dir(path: str) -> str:
    """A tag directory from a checkpoint directory (via `latest`) or a tag directory itself."""
    tag = latest_tag(path)
    if tag is not None:
        return os.path.join(path, tag)
    if os.path.isfile(os.path.join(path, model_states_name(path))):
        return path
    raise CheckpointMismatchError(f"{path} is neither a checkpoint directory (no 'latest' file) nor a tag directory "
                                  f"(no {MODEL_STATES}). Pass the directory given to save_checkpoint, or a tag in it.")


def check_unlisted(tag_dir: str, ours: bool) -> None:
    """A tag without a manifest: an error for a deepspeed_bnb checkpoint (every save writes one, so it was lost and
    nothing can be verified) unless the user trusts it; a loud warning for a stock DeepSpeed one."""
    if ours and not trusted():
        raise CheckpointMismatchError(
            f"{tag_dir} has no {MANIFEST_NAME}, but it is a deepspeed_bnb checkpoint and every deepspeed_bnb save "
            f"writes one: it was deleted or not copied, so nothing in these files can be verified (a damaged or "
            f"altered tensor would load silently). Copy the manifest along with the checkpoint from its source. If "
            f"you trust these files as they are, set {TRUST_ENV}=1 for this load, or write a verified copy once with "
            f"`deepspeed-bnb migrate {tag_dir} NEW_DIR --trust`.")
    kind = "a trusted deepspeed_bnb" if ours else "a stock DeepSpeed"
    warnings.warn(f"deepspeed_bnb: {tag_dir} has no {MANIFEST_NAME} ({kind} checkpoint): nothing in it can be "
                  f"verified; a damaged or altered file would load silently.", RuntimeWarning, stacklevel=2)


class SavedCheckpoint:
    """One tag of a checkpoint written by deepspeed_bnb (or, for `stock_*`, by stock DeepSpeed).

    `verify_checksums`: hash every file against the manifest first (what every tool that writes does); `mp_rank`:
    the model-parallel rank whose files are read (a tensor- or pipeline-parallel run writes one set per rank;
    merged.py joins them)."""

    def __init__(self, path: str, verify_checksums: bool = False, mp_rank: int = 0):
        self.tag_dir = resolve_tag_dir(path)
        self.mp_rank = mp_rank
        self.model_parallel = model_parallel_size(self.tag_dir)  # model-parallel ranks that wrote the tag
        self.manifest = read_manifest(self.tag_dir)
        if self.manifest is not None:
            verify(self.tag_dir, self.manifest, sorted(self.manifest["files"]) if verify_checksums else ())
        self.dp, self.bf16_names, names = saved_dp(self.model_states, self.tag_dir, self.model_states_path, mp_rank)
        self.source = FileSource([os.path.join(self.tag_dir, names[r]) for r in range(self.dp)])
        if self.manifest is None:
            check_unlisted(self.tag_dir, self.is_deepspeed_bnb)
        if self.is_deepspeed_bnb:  # every count a reader will allocate from, checked against the files first
            check_saved_records(self.source)
            self._check_param_shapes()

    @property
    def model_states_path(self) -> str:
        return os.path.join(self.tag_dir, model_states_name(self.tag_dir, self.mp_rank))

    @property
    def model_states(self) -> dict:
        if not hasattr(self, "_model_states"):
            self._model_states = check_model_states(load_file(self.model_states_path), self.model_states_path)
        return self._model_states

    def _check_param_shapes(self) -> None:
        """The model states name every parameter of the records with its number of elements."""
        try:
            shapes = self.param_shapes()
        except KeyError as exc:
            raise CheckpointMismatchError(f"{self.model_states_path}: 'param_shapes' does not name the parameter "
                                          f"{exc} of the optimizer records; the files are of different runs.") from None
        for g, group_shapes in enumerate(shapes):
            numels = [torch.Size(shape).numel() for shape in group_shapes.values()]
            parts = self.parts(g)
            names = [name for part in parts for name in part.names]
            saved = tuple(numel for part in parts for numel in part.layout.numels)
            if list(group_shapes) != names or tuple(numels) != saved:
                raise CheckpointMismatchError(
                    f"{self.model_states_path}: 'param_shapes' of param group {g} ({len(numels)} parameters, "
                    f"{sum(numels):,} elements) differ from the optimizer records' ({len(saved)}, {sum(saved):,}); "
                    f"the files are of different runs.")

    def optimizer_state(self, rank: int) -> dict:
        return self.source.state(rank)

    def record(self, rank: int) -> dict:
        record = self.source.state(rank).get(C.BASE_OPTIMIZER_STATE_KEY)
        check_record(record, self.source.name(rank), self.optimizer_class)
        return record

    @property
    def optimizer_class(self) -> str:
        record = self.source.state(0).get(C.BASE_OPTIMIZER_STATE_KEY)
        return record.get(C.OPTIMIZER_CLASS_KEY, "?") if isinstance(record, dict) else "?"

    @property
    def is_deepspeed_bnb(self) -> bool:
        return is_record(self.source.state(0).get(C.BASE_OPTIMIZER_STATE_KEY))

    @property
    def master_mode(self) -> str:
        """The master weights of the run that wrote it ("fp32", "bf16" or "bf16+8"; optim/master_weights.py)."""
        return saved_master_mode(self.record(0))

    @property
    def groups(self) -> List[dict]:
        return self.record(0)[C.GROUPS_KEY]

    @property
    def zero_stage(self) -> int:
        return int(self.optimizer_state(0).get("zero_stage", 2))

    def layout(self, g: int):
        """GroupLayout (stage 1/2) or ShardedLayout (stage 3) of group g as saved."""
        return layout_from_dict(self.groups[g][C.LAYOUT_KEY])

    def key_classes(self, g: int) -> FlatKeys:
        return FlatKeys(self.groups[g][C.KEY_CLASSES_KEY])

    def parts(self, g: int) -> List[SavedPart]:
        """The saved partitionings of group g: one over every rank file, or, in an expert group (DeepSpeed MoE), one
        per expert-parallel rank, each holding its experts (global names) over its expert-data-parallel files."""
        return saved_parts(self.record, g, self.dp, self.source.name)

    @property
    def has_experts(self) -> bool:
        return any(C.EXPERTS_KEY in group for group in self.groups)

    def refuse_experts(self, what: str) -> None:
        """An error for the offline writers that lay a group out over ranks themselves, which expert groups are
        not yet (their experts live on expert-parallel ranks the checkpoint alone does not choose for a new run)."""
        if self.has_experts:
            raise CheckpointMismatchError(
                f"{self.tag_dir} holds expert groups (DeepSpeed MoE), which `{what}` does not handle yet. "
                f"engine.load_checkpoint loads such a checkpoint at any data-parallel size and any expert-parallel "
                f"size over the same experts; `deepspeed-bnb export` writes its weights and state by name.")

    def refuse_model_parallel(self, what: str) -> None:
        """An error for the offline tools that read one model-parallel rank's files (the model's part that rank held),
        where the tag holds several."""
        if self.model_parallel > 1:
            raise CheckpointMismatchError(
                f"{self.tag_dir} was written by {self.model_parallel} model-parallel ranks (tensor-parallel ranks or "
                f"pipeline stages: files *_mp_rank_00_* to *_mp_rank_{self.model_parallel - 1:02d}_*), and `{what}` "
                f"reads one rank's share, which is not the model. `deepspeed-bnb export --universal` joins them into "
                f"an 8-bit universal checkpoint, which an engine loads with checkpoint.load_universal.")

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        """Per group: parameter name -> shape, in flat order (DeepSpeed saves these with the model states: per param
        group at stage 1/2, per ZeRO-3 sub-group at stage 3, which our records join into param groups again; an
        expert group's are rank 0's experts, and every other part's experts have their shapes in the same order)."""
        saved = [dict(shapes) for shapes in self.model_states["param_shapes"]]
        if not self.is_deepspeed_bnb:
            return saved
        if len(saved) != len(self.groups):
            merged = {name: shape for shapes in saved for name, shape in shapes.items()}
            saved = [{name: merged[name] for name in group[C.PARAM_NAMES_KEY]} for group in self.groups]
        for g, group in enumerate(self.groups):
            if C.EXPERTS_KEY in group:
                parts, shapes = self.parts(g), list(saved[g].values())
                if list(saved[g]) != list(parts[0].names):
                    raise CheckpointMismatchError(
                        f"{self.model_states_path}: 'param_shapes' of param group {g} do not name the experts of rank "
                        f"0's optimizer record; the files are of different runs.")
                saved[g] = {name: shape for part in parts for name, shape in zip(part.names, shapes)}
        return saved

    def param_states(self, g: int) -> List[ParamState]:
        """The state of every parameter of group g, part by part (see param_state.gather_param_states)."""
        whole = self.key_classes(g).whole(self.groups[g][C.STATE_KEY])  # saved once, by rank 0
        out = []
        for part in self.parts(g):
            states = [{**self.record(rank)[C.GROUPS_KEY][g][C.STATE_KEY], **whole} for rank in part.files]
            out += gather_param_states(part.layout, part.eight_bit, self.key_classes(g), states)
        return out

    def master_weights(self, g: int) -> List[torch.Tensor]:
        """fp32 master weights of every parameter of group g (flattened), joined from every rank, part by part (bf16
        master weights widened: exact)."""
        layouts = [layout_from_dict(saved.get(C.MASTER_LAYOUT_KEY, saved[C.LAYOUT_KEY])) for saved in self.groups]
        out = []
        for part in self.parts(g):
            pieces: Dict[int, list] = {}
            for k, rank in enumerate(part.files):
                master = saved_master(self.optimizer_state(rank), self.record(rank), g, layouts)
                for seg in part.master_layout.segments(k, part.eight_bit):
                    pieces.setdefault(seg.slot, []).append(master.narrow(0, seg.offset, seg.numel))
            out += [torch.cat(pieces[slot]).float() for slot in range(len(part.names))]
        return out

    def empty_group(self, g: int, dp: int, rank: int, stage: int = 2) -> GroupRecord:
        """A zero GroupRecord of group g for `rank` of a layout at `dp` ranks and ZeRO `stage`, shaped like the saved
        state."""
        saved = self.groups[g]
        layout = (ShardedLayout if stage == 3 else GroupLayout)(self.layout(g).numels, dp)
        return empty_group_record(layout, rank, saved[C.PARAM_NAMES_KEY],
                                  saved[C.EIGHT_BIT_KEY], self.key_classes(g), saved[C.STATE_KEY],
                                  saved[C.HYPERPARAMS_KEY])

    def other_files(self) -> List[str]:
        """Files of the tag that are neither rank optimizer files, stage-3 model states nor the manifest (the model
        states, DeepSpeed's other files), as paths relative to the tag: the manifest's list when there is one."""
        names = self.manifest["files"] if self.manifest is not None else tag_files(self.tag_dir)
        return sorted(name for name in names
                      if not _RANK_FILE.match(name) and not _STAGE3_MODEL_FILE.match(name) and name != MANIFEST_NAME)
