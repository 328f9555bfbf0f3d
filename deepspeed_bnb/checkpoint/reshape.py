"""Offline resharding: rewrite a deepspeed_bnb checkpoint for another data-parallel size (lossless copy).

Engines built with deepspeed_bnb load a checkpoint at any DP size directly; `reshape` writes the files a run at DP
size M would have written, for tools that expect them or to spread the read load of a later resume. It also writes
the per-rank files other offline writers (convert) produce, through `write_rank_files`.
"""

import os
import shutil
from collections import OrderedDict
from typing import Callable, List

import torch
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE_STEP, GROUP_PADDINGS, PARAM_ALIGNMENT_PADDINGS, \
    PARAM_SLICE_MAPPINGS, PARTITION_COUNT
from deepspeed.utils.tensor_fragment import fragment_address
from tqdm import tqdm

from deepspeed_bnb.checkpoint import constants as C
from deepspeed_bnb.checkpoint.manifest import describe, fresh_staging, publish_staged
from deepspeed_bnb.checkpoint.partition_state import GroupRecord, build_record, load_records
from deepspeed_bnb.checkpoint.reader import MODEL_STATES, SavedCheckpoint
from deepspeed_bnb.checkpoint.sources import OPTIMIZER_STATE_DICT


def rank_file_name(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def rank_state_dict(base: dict, groups: List[GroupRecord], rank: int, dp: int, optimizer_class: str,
                    optimizer_name: str) -> dict:
    """DeepSpeed's per-rank optimizer state for `groups` (filled GroupRecords of `rank`), other keys from `base`."""
    state = {k: v for k, v in base.items()
             if k not in (C.BASE_OPTIMIZER_STATE_KEY, C.MASTER_WEIGHTS_KEY, BASE_OPTIMIZER_STATE_STEP)}
    state[C.MASTER_WEIGHTS_KEY] = [
        g.master.narrow(0, 0, g.layout.partition_size - g.layout.tail_padding(rank)).clone() for g in groups]
    state[GROUP_PADDINGS] = [g.layout.tail_padding(rank) for g in groups]
    state[PARTITION_COUNT] = [dp] * len(groups)
    state[PARAM_ALIGNMENT_PADDINGS] = [[slot.padding for slot in g.layout.slots] for g in groups]
    state[PARAM_SLICE_MAPPINGS] = [
        OrderedDict((g.param_names[seg.slot], fragment_address(numel=seg.numel, start=seg.offset))
                    for seg in g.layout.segments(rank, g.eight_bit)) for g in groups]
    state[C.BASE_OPTIMIZER_STATE_KEY] = build_record(optimizer_class, optimizer_name, rank, groups)
    return state


def write_rank_files(ckpt: SavedCheckpoint, out_dir: str, dp: int, fill: Callable[[int], List[GroupRecord]],
                     optimizer_class: str, optimizer_name: str, progress: bool = True) -> str:
    """Stage and publish a new tag in `out_dir`: model states of `ckpt` (at DP `dp`) and one file per new rank with
    the groups `fill(rank)` returns. Returns the published tag directory."""
    tag = os.path.basename(os.path.normpath(ckpt.tag_dir))
    staged = fresh_staging(out_dir, tag)
    for name in ckpt.other_files():
        if name == MODEL_STATES:
            states = dict(ckpt.model_states)
            states["dp_world_size"] = dp
            torch.save(states, os.path.join(staged, name))
        else:
            shutil.copy2(os.path.join(ckpt.tag_dir, name), os.path.join(staged, name))
    described = None
    for rank in tqdm(range(dp), desc="rank files", disable=not progress):
        groups = fill(rank)
        blob = dict(ckpt.source.blob(min(rank, ckpt.dp - 1)))
        blob[OPTIMIZER_STATE_DICT] = rank_state_dict(blob[OPTIMIZER_STATE_DICT], groups, rank, dp, optimizer_class,
                                                     optimizer_name)
        torch.save(blob, os.path.join(staged, rank_file_name(rank, ckpt.bf16_names)))
        described = [(g.param_names, g.layout.numels, g.eight_bit) for g in groups]
    stage = int(ckpt.optimizer_state(0).get("zero_stage", 2))
    return publish_staged(out_dir, tag, describe(optimizer_class, stage, dp, described))


def reshape(path: str, out_dir: str, dp: int, progress: bool = True) -> str:
    """Write checkpoint `path` (a checkpoint or tag directory) into `out_dir` for `dp` data-parallel ranks."""
    if dp < 1:
        raise ValueError(f"reshape: --dp must be a positive number of ranks, got {dp}")
    ckpt = SavedCheckpoint(path)
    first = ckpt.record(0)

    def fill(rank):
        groups = [ckpt.empty_group(g, dp, rank) for g in range(len(ckpt.groups))]
        load_records(ckpt.source, groups, rank, first[C.OPTIMIZER_CLASS_KEY], True, True)
        return groups

    return write_rank_files(ckpt, out_dir, dp, fill, first[C.OPTIMIZER_CLASS_KEY], first[C.OPTIMIZER_NAME_KEY],
                            progress)
