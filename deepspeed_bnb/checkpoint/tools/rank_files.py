"""Writes a new tag's files from per-parameter state: model states and one optimizer file per rank, for any DP size
and ZeRO stage. The offline writers (reshape, migrate, convert, --from-bnb, universal inputs) all publish through
`write_rank_files`.

Stage 3 files hold DeepSpeed's `fp32_flat_groups` in stock ZeRO-3 slices (what zero_to_fp32 reads) and one
model-states file per rank; stage 1/2 files hold `single_partition_of_fp32_groups` and one model-states file.
"""

import copy
import math
import os
import shutil
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE_STEP, GROUP_PADDINGS, PARAM_SLICE_MAPPINGS, \
    PARTITION_COUNT
from deepspeed.utils.tensor_fragment import fragment_address
from tqdm import tqdm

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.constants import MODEL_STATES, MODEL_STATES_OF, STAGE3_MODEL_STATES_OF
from deepspeed_bnb.checkpoint.format.manifest import describe
from deepspeed_bnb.checkpoint.format.model_parallel import ALONE, ModelParallelPlace
from deepspeed_bnb.checkpoint.format.publish import offline_write, publish_staged
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.records import GroupRecord, build_record
from deepspeed_bnb.checkpoint.format.sources import OPTIMIZER_STATE_DICT
from deepspeed_bnb.checkpoint.format.weights import FROZEN_FRAGMENTS, FROZEN_SHAPES, frozen_weights, module_tensors, \
    zero3_slice
from deepspeed_bnb.optim import master_weights
from deepspeed_bnb.state_layout import ShardedLayout

# rewritten per stage (OPTIMIZER_STATE_DICT: a stock ZeRO-3 source's torch state_dict inside its ZeRO state, which the
# records replace; deepspeed_bnb's ZeRO-3 saves drop it too)
STAGE_SPECIFIC = (C.BASE_OPTIMIZER_STATE_KEY, C.MASTER_WEIGHTS_KEY, BASE_OPTIMIZER_STATE_STEP, GROUP_PADDINGS,
                  C.PARAM_ALIGNMENT_PADDINGS, PARAM_SLICE_MAPPINGS, C.FP32_FLAT_GROUPS_KEY, OPTIMIZER_STATE_DICT)


def rank_file_name(rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return C.RANK_FILE.format("bf16_" if bf16 else "", rank, mp_rank)


def rank_state_dict(base: dict, groups: List[GroupRecord], rank: int, dp: int, optimizer_class: str,
                    optimizer_name: str, full_masters: Optional[Callable[[int], List]] = None,
                    master_mode: str = master_weights.FP32, model_parallel: ModelParallelPlace = ALONE) -> dict:
    """DeepSpeed's per-rank optimizer state for `groups` (filled GroupRecords of `rank`), other keys from `base`.
    Stage 3 (ShardedLayout groups) needs `full_masters(g)`: every parameter's fp32 weights, for the stock slices.
    `master_mode`: the master weights the files are for, which decide the dtype the master weights are written in
    (bf16 for "bf16"); the writer has made the values representable in it (write_rank_files). `model_parallel`: the
    place of the model-parallel rank the file is for."""
    dtype = torch.bfloat16 if master_mode == master_weights.BF16 else torch.float32
    state = {k: v for k, v in base.items() if k not in STAGE_SPECIFIC}
    if groups and isinstance(groups[0].layout, ShardedLayout):
        state[C.ZERO_STAGE_KEY] = 3
        state[PARTITION_COUNT] = dp
        state[C.FP32_FLAT_GROUPS_KEY] = []
        for g, group in enumerate(groups):
            group.master_layout = ShardedLayout(group.layout.numels, dp, block=1)
            pieces = []
            for j, master in enumerate(full_masters(g)):
                pieces.append(zero3_slice(master.reshape(-1), rank, group.master_layout.slice_numel(j)).to(dtype))
            state[C.FP32_FLAT_GROUPS_KEY].append(torch.cat(pieces))
        state[C.BASE_OPTIMIZER_STATE_KEY] = build_record(optimizer_class, optimizer_name, rank, groups,
                                                         master_entry=C.FP32_FLAT_GROUPS_KEY, master_mode=master_mode,
                                                         model_parallel=model_parallel)
        return state
    if state.get(C.ZERO_STAGE_KEY) == 3:  # from a stage-3 checkpoint: DeepSpeed's stage-1/2 keys
        state[C.ZERO_STAGE_KEY] = 2
    state[C.MASTER_WEIGHTS_KEY] = [
        g.master.narrow(0, 0, g.layout.partition_size - g.layout.tail_padding(rank)).to(dtype, copy=True)
        for g in groups]
    state[GROUP_PADDINGS] = [g.layout.tail_padding(rank) for g in groups]
    state[PARTITION_COUNT] = [dp] * len(groups)
    state[C.PARAM_ALIGNMENT_PADDINGS] = [[slot.padding for slot in g.layout.slots] for g in groups]
    state[PARAM_SLICE_MAPPINGS] = [
        OrderedDict((g.param_names[seg.slot], fragment_address(numel=seg.numel, start=seg.offset))
                    for seg in g.layout.segments(rank, g.eight_bit)) for g in groups]
    state[C.BASE_OPTIMIZER_STATE_KEY] = build_record(optimizer_class, optimizer_name, rank, groups,
                                                     master_mode=master_mode, model_parallel=model_parallel)
    return state


def model_states_for(ckpt: SavedCheckpoint, dp: int, stage: int, frozen: Optional[dict] = None,
                     module: Optional[dict] = None) -> dict:
    """The checkpoint's model states for `dp` ranks at `stage`, module weights as DeepSpeed's save of that stage holds
    them. A stage-3 target: an empty placeholder for every trained and frozen parameter (its engine takes the trained
    weights from fp32_flat_groups and the frozen ones from each rank's fragments, frozen_fragments, and refuses a whole
    tensor for a partitioned parameter). A stage-1/2 target: every parameter whole, the trained ones the fp32 master
    weights where the source holds none (universal checkpoints and plain bnb runs carry none, stage-3 files
    placeholders), in the module's dtype where known; `frozen` (the source's frozen parameters, whole:
    weights.frozen_weights) whole in `module` and in its fragments. Buffers stay as the source holds them. `module`:
    the source's module tensors (weights.module_tensors), if already read."""
    states = dict(ckpt.model_states)
    states["dp_world_size"] = dp
    config = copy.deepcopy(states.get("ds_config"))
    if isinstance(config, dict):
        config.setdefault("zero_optimization", {})["stage"] = stage
        states["ds_config"] = config
    module = dict(module_tensors(ckpt) if module is None else module)  # a pipeline's from its layer files
    if stage == 3:  # tied weights' other names (shared_params) are parameters too
        parameters = [name for shapes in ckpt.param_shapes() for name in shapes] + list(frozen or {}) + \
            [name for name in states.get("shared_params") or {} if name in module]
        for name in parameters:
            module[name] = torch.empty(0, dtype=module[name].dtype if name in module else torch.float32)
        states["module"] = module
        if frozen:
            states[FROZEN_SHAPES] = {name: weights.shape for name, weights in frozen.items()}
        return states

    def held(name, shape):
        return name in module and module[name].numel() == torch.Size(shape).numel()

    for g, shapes in enumerate(ckpt.param_shapes()):
        if all(held(name, shape) for name, shape in shapes.items()):
            continue
        for (name, shape), master in zip(shapes.items(), ckpt.master_weights(g)):
            if not held(name, shape):
                module[name] = master.reshape(shape).to(module[name].dtype if name in module else torch.float32)
    if frozen:
        for name, weights in frozen.items():  # a stage-3 source's module holds empty placeholders of them
            if name not in module or module[name].numel() != weights.numel():
                module[name] = weights.to(module[name].dtype if name in module else weights.dtype)
        states[FROZEN_SHAPES] = {name: weights.shape for name, weights in frozen.items()}
        states[FROZEN_FRAGMENTS] = dict(frozen)
    states["module"] = module
    return states


def frozen_fragments(frozen: dict, rank: int, dp: int) -> dict:
    """What rank `rank` of a ZeRO-3 run at `dp` ranks holds of each frozen parameter, as DeepSpeed's save writes it
    (`frozen_param_fragments`): its slice of ceil(numel / dp) elements (the partition DeepSpeed's ZeRO-3 gives every
    parameter)."""
    return {name: zero3_slice(weights.reshape(-1), rank, math.ceil(weights.numel() / dp))
            for name, weights in frozen.items()}


class RanklessSource:
    """What write_rank_files reads from a source that has no ZeRO rank files of its own (a DeepSpeed universal
    checkpoint, a plain bnb run): the subclass provides `model_states` (with `ds_version` and `ds_config`), `tag_dir`,
    `dp`, `zero_stage`, `param_shapes()` and `master_weights(g)`; the new rank files' other entries derive from
    those."""

    bf16_names = False  # the optimizer files to write: DeepSpeed's fp32-mode names
    is_deepspeed_bnb = False
    master_mode = master_weights.FP32  # such sources hold fp32 weights

    def other_files(self) -> List[str]:
        return []

    @property
    def source(self):
        return self

    def blob(self, rank: int) -> dict:
        """What a ZeRO optimizer file holds besides the state a writer puts there (stage keys are added per rank)."""
        version = self.model_states.get("ds_version")
        return {OPTIMIZER_STATE_DICT: {"ds_version": version}, "ds_version": version,
                "ds_config": self.model_states.get("ds_config")}


def source_master_mode(ckpt) -> str:
    """The master weights `ckpt` was saved with (a stock or rankless source's are fp32)."""
    return ckpt.master_mode if ckpt.is_deepspeed_bnb else master_weights.FP32


def write_rank_files(ckpt: SavedCheckpoint, out_dir: str, dp: int, fill: Callable[[int], List[GroupRecord]],
                     optimizer_class: str, optimizer_name: str, progress: bool = True,
                     stage: Optional[int] = None, master_mode: Optional[str] = None) -> str:
    """Stage and publish a new tag in `out_dir`: model states of `ckpt` (at DP `dp` and ZeRO `stage`, the source's by
    default) and one file per new rank with the groups `fill(rank)` returns, for master weights `master_mode` (the
    source's by default; another mode rounds the weights as that mode holds them: master_weights.representable).
    Returns the published tag directory."""
    return write_model_parallel_files([(ckpt, fill)], out_dir, dp, optimizer_class, optimizer_name, progress, stage,
                                      master_mode)


def write_model_parallel_files(ranks: Sequence[Tuple[object, Callable[[int], List[GroupRecord]]]], out_dir: str,
                               dp: int, optimizer_class: str, optimizer_name: str, progress: bool = True,
                               stage: Optional[int] = None, master_mode: Optional[str] = None) -> str:
    """write_rank_files for a tag of several model-parallel ranks: `ranks[r]` is (the source of model-parallel rank
    r's parameters, its fill), whose files are named `*_mp_rank_<r>_*`. One tag, one manifest (described by rank 0's
    groups)."""
    first = ranks[0][0]
    stage = first.zero_stage if stage is None else stage
    mode = source_master_mode(first) if master_mode is None else master_weights.check_mode(master_mode,
                                                                                          "--master-weights")
    tag = os.path.basename(os.path.normpath(first.tag_dir))
    check_output(first, out_dir)
    with offline_write(out_dir, tag) as staged:  # removed again if anything below fails
        for name in first.other_files():
            if name != MODEL_STATES:
                target = os.path.join(staged, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(os.path.join(first.tag_dir, name), target)
        described = None
        for mp_rank, (ckpt, fill) in enumerate(ranks):
            groups = _stage_rank_files(ckpt, staged, dp, fill, optimizer_class, optimizer_name, progress, stage,
                                       mode, mp_rank, len(ranks))
            described = described or groups
        return publish_staged(out_dir, tag, describe(optimizer_class, stage, dp, described, mode))


def _stage_rank_files(ckpt, staged: str, dp: int, fill, optimizer_class: str, optimizer_name: str, progress: bool,
                      stage: int, mode: str, mp_rank: int, mp_size: int):
    """One model-parallel rank's model states and rank files into `staged`; returns its groups' description."""
    switched = mode != source_master_mode(ckpt)  # the source's own values are what their mode holds already
    module = module_tensors(ckpt)  # read once (a pipeline's layer files)
    frozen = frozen_weights(ckpt, module=module)
    states = model_states_for(ckpt, dp, stage, frozen, module)
    states["mp_world_size"] = mp_size
    if stage == 3:  # one model-states file per rank: each with that rank's slices of the frozen parameters
        for rank in range(dp):
            own = {**states, FROZEN_FRAGMENTS: frozen_fragments(frozen, rank, dp)} if frozen else states
            torch.save(own, os.path.join(staged, STAGE3_MODEL_STATES_OF.format(rank, mp_rank)))
    else:
        torch.save(states, os.path.join(staged, MODEL_STATES_OF.format(mp_rank)))
    masters = {}

    def full_masters(g):  # every parameter's fp32 weights, read once per group (stage-3 targets only)
        if g not in masters:
            masters[g] = [master_weights.representable(w, mode) if switched else w for w in ckpt.master_weights(g)]
        return masters[g]

    described = None
    for rank in tqdm(range(dp), desc="rank files", disable=not progress):
        groups = fill(rank)
        for group in groups if switched else ():  # the values the written mode holds
            group.master.copy_(master_weights.representable(group.master, mode))
        blob = dict(ckpt.source.blob(min(rank, ckpt.dp - 1)))
        blob[OPTIMIZER_STATE_DICT] = rank_state_dict(blob[OPTIMIZER_STATE_DICT], groups, rank, dp,
                                                     optimizer_class, optimizer_name, full_masters, mode,
                                                     getattr(ckpt, "place", ALONE))
        torch.save(blob, os.path.join(staged, rank_file_name(rank, ckpt.bf16_names, mp_rank)))
        described = [(g.param_names, g.layout.numels, g.eight_bit) for g in groups]
    return described


MAX_DP = 4096  # more rank files than this needs allow_large_dp: a typo (--dp 100000) would write 100,002 files


def check_dp(verb: str, dp: int, allow_large_dp: bool = False) -> int:
    """A DP size to write files for: a positive number of ranks, and at most MAX_DP unless asked for."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"{verb}: --dp must be a positive number of ranks, got {dp!r}")
    if dp > MAX_DP and not allow_large_dp:
        raise ValueError(f"{verb}: --dp {dp} would write {dp} rank files (more than {MAX_DP}); if that is really the "
                         f"data-parallel size of the run, pass --allow-large-dp.")
    return dp


def check_output(ckpt: SavedCheckpoint, out_dir: str, tag: Optional[str] = None) -> None:
    """An offline writer's output directory is neither the checkpoint it reads nor inside it (the new tag would
    replace or nest in the source, the only copy of what is being rewritten). `tag`: the output's tag, where it may
    differ from the input's: then the directory holding the input may take it beside the input."""
    source_dir = os.path.realpath(os.path.dirname(os.path.normpath(ckpt.tag_dir)))
    tag_dir, out = os.path.realpath(ckpt.tag_dir), os.path.realpath(out_dir)
    beside = tag is not None and os.path.realpath(os.path.join(out, tag)) != tag_dir
    if (out == source_dir and not beside) or out == tag_dir or out.startswith(tag_dir + os.sep):
        raise ValueError(f"the output directory {out_dir} is the checkpoint being read ({ckpt.tag_dir}) or inside it: "
                         f"writing there would replace the source. Give a new directory (and move it into place "
                         f"afterwards if you want to).")
