"""DeepSpeed's `ds_to_universal.main`, for checkpoints of deepspeed_bnb: the 8-bit universal checkpoint.

DeepSpeed's converter reads every optimizer state as torch Adam's element-wise `exp_avg` / `exp_avg_sq` fragments
(DeepSpeed 0.19.8: "Required universal_checkpoint_info state is missing" on a checkpoint without the client state it
wants, `KeyError: 'exp_avg'` on bnb state once that is supplied). While deepspeed_bnb is imported, `main` converts a
checkpoint of ours with `deepspeed-bnb export --universal` instead (checkpoint/tools/universal.py: every parameter's
8-bit codes, block scales and maps as saved), into the tag folder DeepSpeed's arguments name, so scripts and tests
that call DeepSpeed's converter in-process (`from deepspeed.checkpoint.ds_to_universal import main`) get a universal
checkpoint an engine of ours loads with `"checkpoint": {"load_universal": true}`. Any other checkpoint goes to
DeepSpeed's own converter unchanged. DeepSpeed's worker counts, `strict` and `inject_missing_state` do not apply to
ours (the export reads each parameter once and checks every file against the manifest). The `ds_to_universal` command
line runs without deepspeed_bnb and stays DeepSpeed's: use `deepspeed-bnb export --universal` there.
"""

import os
import warnings

from deepspeed_bnb import installer
from deepspeed_bnb.checkpoint.format.merged import whole_model
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint


def ours(tag_dir: str):
    """The checkpoint in `tag_dir` when deepspeed_bnb wrote it, else None (a stock one is DeepSpeed's to convert). A
    checkpoint of ours that cannot be read (its manifest lost, a file damaged) raises the reader's error naming it,
    rather than going to a converter that cannot read it either."""
    with warnings.catch_warnings():  # a stock checkpoint has no manifest, which the reader warns about
        warnings.simplefilter("ignore", RuntimeWarning)
        ckpt = SavedCheckpoint(tag_dir)
    return whole_model(ckpt) if ckpt.is_deepspeed_bnb else None  # tensor / pipeline ranks joined


def main(args):
    """Convert `args.input_folder` (a tag folder) into the universal checkpoint `args.output_folder` (a tag folder
    beside it, as DeepSpeed's converter writes it)."""
    ckpt = ours(args.input_folder)
    if ckpt is None:
        return installer.stock("ds_to_universal.main")(args)
    from deepspeed_bnb.checkpoint.tools.universal import write_universal
    out = os.path.normpath(args.output_folder)
    print(f"deepspeed_bnb: {args.input_folder} is a deepspeed_bnb checkpoint: writing the 8-bit universal checkpoint "
          f"{out} (deepspeed-bnb export --universal)")
    write_universal(ckpt, os.path.dirname(out) or ".", progress=False, tag=os.path.basename(out))
