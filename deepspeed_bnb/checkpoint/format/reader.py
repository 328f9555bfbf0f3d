"""Opens a saved deepspeed_bnb checkpoint offline (no process group): manifest, model states, per-rank records.

`SavedCheckpoint(path)` accepts a checkpoint directory (it follows `latest`) or a tag directory. Rank files are
memory-mapped and read on demand; a rank's partition becomes per-parameter state with `param_states`, and a group
becomes a live-shaped GroupRecord for any rank of any DP size with `empty_group` (what reshape and convert fill).
"""

import os
import re
import warnings
from typing import Dict, List

import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME, latest_tag, read_manifest, verify
from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.records import GroupRecord, check_record, \
    empty_group_record, is_record, saved_master
from deepspeed_bnb.checkpoint.format.safe_load import TRUST_ENV, load_file, trusted
from deepspeed_bnb.checkpoint.format.sources import FileSource
from deepspeed_bnb.optim.state_classes import StateClass
from deepspeed_bnb.state_layout import GroupLayout, ShardedLayout, layout_from_dict

MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-1/2: one model-states file
STAGE3_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"  # ZeRO-3: one per DP rank (empty module weights)
_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_STAGE3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def model_states_name(tag_dir: str) -> str:
    """The model-states file a loader reads first: stage 1/2's, or stage 3's of rank 0."""
    for name in (MODEL_STATES, STAGE3_MODEL_STATES.format(0)):
        if os.path.isfile(os.path.join(tag_dir, name)):
            return name
    return MODEL_STATES


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

    `verify_checksums`: hash every file against the manifest first (what every tool that writes does)."""

    def __init__(self, path: str, verify_checksums: bool = False):
        self.tag_dir = resolve_tag_dir(path)
        self.manifest = read_manifest(self.tag_dir)
        if self.manifest is not None:
            verify(self.tag_dir, self.manifest, sorted(self.manifest["files"]) if verify_checksums else ())
        ranks = {}
        for name in os.listdir(self.tag_dir):
            match = _RANK_FILE.match(name)
            if match:
                ranks.setdefault(bool(match.group(1)), {})[int(match.group(2))] = name
        if not ranks:
            raise CheckpointMismatchError(f"{self.tag_dir} holds no ZeRO optimizer files (*_optim_states.pt).")
        self.bf16_names = True in ranks
        names = ranks[self.bf16_names]
        self.dp = int(self.model_states.get("dp_world_size", len(names)))
        missing = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"  # named in the error FileSource raises
        self.source = FileSource([os.path.join(self.tag_dir, names.get(r, missing.format(r))) for r in range(self.dp)])
        if self.manifest is None:
            check_unlisted(self.tag_dir, self.is_deepspeed_bnb)

    @property
    def model_states(self) -> dict:
        if not hasattr(self, "_model_states"):
            path = os.path.join(self.tag_dir, model_states_name(self.tag_dir))
            if not os.path.isfile(path):
                raise CheckpointMismatchError(f"{path} is missing.")
            self._model_states = load_file(path, mmap=True)
        return self._model_states

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
    def groups(self) -> List[dict]:
        return self.record(0)[C.GROUPS_KEY]

    @property
    def zero_stage(self) -> int:
        return int(self.optimizer_state(0).get("zero_stage", 2))

    def layout(self, g: int):
        """GroupLayout (stage 1/2) or ShardedLayout (stage 3) of group g as saved."""
        return layout_from_dict(self.groups[g][C.LAYOUT_KEY])

    def key_classes(self, g: int) -> Dict[str, StateClass]:
        return {k: StateClass(v) for k, v in self.groups[g][C.KEY_CLASSES_KEY].items()}

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        """Per group: parameter name -> shape, in flat order (DeepSpeed saves these with the model states: per param
        group at stage 1/2, per ZeRO-3 sub-group at stage 3, which our records join into param groups again)."""
        saved = [dict(shapes) for shapes in self.model_states["param_shapes"]]
        if not self.is_deepspeed_bnb or len(saved) == len(self.groups):
            return saved
        merged = {name: shape for shapes in saved for name, shape in shapes.items()}
        return [{name: merged[name] for name in group[C.PARAM_NAMES_KEY]} for group in self.groups]

    def param_states(self, g: int) -> List[dict]:
        """bnb-style state of every parameter of group g (see param_state.gather_param_states)."""
        states = []
        whole = {k: v for k, v in self.groups[g][C.STATE_KEY].items()
                 if self.key_classes(g).get(k) == StateClass.WHOLE}
        for rank in range(self.dp):
            states.append({**self.record(rank)[C.GROUPS_KEY][g][C.STATE_KEY], **whole})
        group = self.groups[g]
        return gather_param_states(self.layout(g), group[C.EIGHT_BIT_KEY], self.key_classes(g), states)

    def master_weights(self, g: int) -> List[torch.Tensor]:
        """fp32 master weights of every parameter of group g (flattened), joined from every rank."""
        group = self.groups[g]
        layout = layout_from_dict(group.get(C.MASTER_LAYOUT_KEY, group[C.LAYOUT_KEY]))
        eight_bit = group[C.EIGHT_BIT_KEY]
        layouts = [layout_from_dict(saved.get(C.MASTER_LAYOUT_KEY, saved[C.LAYOUT_KEY])) for saved in self.groups]
        pieces: Dict[int, list] = {}
        for rank in range(self.dp):
            master = saved_master(self.optimizer_state(rank), self.record(rank), g, layouts)
            for seg in layout.segments(rank, eight_bit):
                pieces.setdefault(seg.slot, []).append(master.narrow(0, seg.offset, seg.numel))
        return [torch.cat(pieces[slot]) for slot in range(len(layout.numels))]

    def empty_group(self, g: int, dp: int, rank: int, stage: int = 2) -> GroupRecord:
        """A zero GroupRecord of group g for `rank` of a layout at `dp` ranks and ZeRO `stage`, shaped like the saved
        state."""
        saved = self.groups[g]
        layout = (ShardedLayout if stage == 3 else GroupLayout)(self.layout(g).numels, dp)
        return empty_group_record(layout, rank, saved[C.PARAM_NAMES_KEY],
                                  saved[C.EIGHT_BIT_KEY], self.key_classes(g), saved[C.STATE_KEY],
                                  saved[C.HYPERPARAMS_KEY])

    def other_files(self) -> List[str]:
        """Files of the tag that are neither rank optimizer files nor the manifest (model states, ...)."""
        return sorted(name for name in os.listdir(self.tag_dir)
                      if not _RANK_FILE.match(name) and not _STAGE3_MODEL_FILE.match(name)
                      and not name.startswith("deepspeed_bnb_manifest"))

