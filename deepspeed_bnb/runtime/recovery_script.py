"""The zero_to_fp32.py beside a ZeRO-1/2 checkpoint, replaced where the DeepSpeed release's own cannot read ours.

DeepSpeed copies its `zero_to_fp32.py` next to every ZeRO checkpoint (`DeepSpeedEngine._copy_recovery_script`), the
script people run to get fp32 weights. Before 0.19.7 that script reads a ZeRO-1/2 group's parameters back to back;
deepspeed_bnb starts every parameter on a 256-element block boundary, which leaves a gap after each parameter whose
size is not a multiple of 256. That script then stops ("consumed N numels out of M - something is wrong"), or, where a
group's gaps add up to fewer than 2 x DP elements (its check tolerates that much), shifts every weight after a gap
without a word. From 0.19.7 it skips the gaps (`param_alignment_paddings`, which deepspeed_bnb writes on every
release). So on the earlier releases a ZeRO-1/2 save leaves a script in its place that names the command that reads
the checkpoint (`deepspeed-bnb export`) and exits with an error; ZeRO-3 tags keep DeepSpeed's (their fp32_flat_groups
hold stock slices).
"""

import os

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # what DeepSpeed copies (zero_to_torch.py too from 0.19.7)

GUARD = '''#!/usr/bin/env python
"""Written by deepspeed_bnb in place of DeepSpeed's {script} (DeepSpeed {version} here).

This DeepSpeed release's {script} reads a ZeRO-1/2 group's parameters back to back. deepspeed_bnb starts every
parameter on a 256-element block boundary, so that script would stop, or, where the gaps between parameters are
small, return every weight after a gap shifted without a word. DeepSpeed 0.19.7 and later read these checkpoints.
"""
import sys

folder = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "CHECKPOINT_DIR"
sys.exit(f"{script} cannot read this deepspeed_bnb checkpoint with DeepSpeed {version} (it would misplace the "
         f"weights). Write the fp32 weights with:\\n  deepspeed-bnb export {{folder}} OUT\\n(OUT/model.safetensors; "
         f"add --optimizer-state for the moments), or use DeepSpeed 0.19.7 or later.")
'''


def reads_block_aligned() -> bool:
    """Whether this DeepSpeed's zero_to_fp32 skips the gaps between ZeRO-1/2 parameters (0.19.7 on)."""
    from deepspeed.utils import zero_to_fp32  # at save only: the module is not needed before
    return hasattr(zero_to_fp32, "PARAM_ALIGNMENT_PADDINGS")


def guard(folder: str, zero_stage: int, version: str) -> None:
    """Replace DeepSpeed's recovery scripts DeepSpeed copied into `folder` (the save directory, or its staging one) by
    the guard, where this release's cannot read a ZeRO-1/2 checkpoint of ours."""
    if zero_stage >= 3 or reads_block_aligned():
        return
    for script in SCRIPTS:
        path = os.path.join(folder, script)
        if os.path.isfile(path):
            with open(path, "w") as f:
                f.write(GUARD.format(script=script, version=version))
