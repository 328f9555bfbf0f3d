"""Offline resharding: rewrite a deepspeed_bnb checkpoint for another data-parallel size and ZeRO stage (lossless),
or in the current format (`migrate`).

Engines built with deepspeed_bnb load a checkpoint at any DP size and stage directly; `reshape` writes the files a run
at DP size M (and stage S) would have written, for tools that expect them or to spread the read load of a later
resume.
"""

from typing import Optional

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.records import load_records
from deepspeed_bnb.checkpoint.tools.rank_files import check_dp, check_output, write_rank_files

def reshape(path: str, out_dir: str, dp: int, progress: bool = True, stage: Optional[int] = None,
            allow_large_dp: bool = False, master_mode: Optional[str] = None) -> str:
    """Write checkpoint `path` (a checkpoint or tag directory) into `out_dir` for `dp` data-parallel ranks at ZeRO
    `stage` (1, 2 or 3; default: the checkpoint's own) and master weights `master_mode` ("fp32", "bf16" or "bf16+8";
    default: the checkpoint's own). Every input file is checked against its SHA-256 first."""
    check_dp("reshape", dp, allow_large_dp)
    if stage is not None and stage not in (1, 2, 3):
        raise ValueError(f"reshape: --stage must be 1, 2 or 3 (a ZeRO stage), got {stage}")
    ckpt = SavedCheckpoint(path, verify_checksums=True)
    if not ckpt.is_deepspeed_bnb:
        raise CheckpointMismatchError(f"{ckpt.tag_dir} is a stock DeepSpeed checkpoint; reshape rewrites deepspeed_bnb "
                                      f"checkpoints. `deepspeed-bnb convert` turns it into one.")
    ckpt.refuse_experts("deepspeed-bnb reshape")
    ckpt.refuse_model_parallel("deepspeed-bnb reshape")
    check_output(ckpt, out_dir)
    first = ckpt.record(0)
    stage = ckpt.zero_stage if stage is None else stage

    def fill(rank):
        groups = [ckpt.empty_group(g, dp, rank, stage) for g in range(len(ckpt.groups))]
        load_records(ckpt.source, groups, rank, first[C.OPTIMIZER_CLASS_KEY], True, True)
        return groups

    return write_rank_files(ckpt, out_dir, dp, fill, first[C.OPTIMIZER_CLASS_KEY], first[C.OPTIMIZER_NAME_KEY],
                            progress, stage, master_mode)


def migrate(path: str, out_dir: str, progress: bool = True) -> str:
    """Rewrite a deepspeed_bnb checkpoint of any format version in the current one (same DP size and stage): a
    manifest with per-tensor checksums, every file readable by the safe loader. Lossless (the files are rebuilt
    from the per-parameter state, as reshape does)."""
    ckpt = SavedCheckpoint(path, verify_checksums=True)
    if not ckpt.is_deepspeed_bnb:
        raise CheckpointMismatchError(f"{ckpt.tag_dir} is a stock DeepSpeed checkpoint; migrate rewrites deepspeed_bnb "
                                      f"checkpoints. `deepspeed-bnb convert` turns it into one.")
    written = reshape(path, out_dir, ckpt.dp, progress, ckpt.zero_stage, allow_large_dp=True)
    from deepspeed_bnb.checkpoint.format.manifest import UNSAFE_KEY, read_manifest
    unsafe = {name: entry[UNSAFE_KEY] for name, entry in read_manifest(written)["files"].items() if UNSAFE_KEY in entry}
    if unsafe:
        raise CheckpointMismatchError(f"{written} was written, but {unsafe} still need trust to load: they hold "
                                      f"objects of the source's client_state or lr scheduler. Load the source in "
                                      f"a trusted engine, replace those entries by plain values and save again.")
    return written
