"""Offline inspection: a human-readable summary of a deepspeed_bnb checkpoint (what `deepspeed-bnb inspect` prints)."""

import os
from typing import List

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.optim import master_weights

MASTER_SAVED = {  # what each master-weights mode keeps, and how its checkpoint holds them
    master_weights.FP32: "fp32 master weights",
    master_weights.BF16: "bf16 master weights, saved in bf16",
    master_weights.COMPENSATED: "bf16 master weights with an 8-bit error term (24 bits), saved as the fp32 values "
                                "they stand for",
}

def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024


def summary(path: str, verify_checksums: bool = False) -> str:
    ckpt = SavedCheckpoint(path, verify_checksums=verify_checksums)
    first_state = ckpt.optimizer_state(0)
    lines: List[str] = [f"checkpoint  {ckpt.tag_dir}"]
    if not ckpt.is_deepspeed_bnb:
        lines.append("  written by stock DeepSpeed (no deepspeed_bnb record): use `deepspeed-bnb convert` to read "
                     "its optimizer state")
        return "\n".join(lines)
    record = ckpt.record(0)
    manifest = ckpt.manifest
    checked = "sizes and SHA-256 verified, every file loads safely" if verify_checksums else \
        "sizes verified (--verify also hashes)"
    lines += [
        f"format      deepspeed_bnb record v{record[C.FORMAT_KEY]}; manifest: "
        + (f"v{manifest['manifest_version']}, {len(manifest['files'])} files, {checked}"
           + ("" if manifest["manifest_version"] >= 2
              else " (no per-tensor checksums: `deepspeed-bnb migrate` adds them)")
           if manifest else "none (nothing verified)"),
        f"written by  ZeRO stage {int(first_state.get('zero_stage', 0))}, {ckpt.dp} data-parallel ranks, "
        f"DeepSpeed {first_state.get('ds_version', ckpt.source.blob(0).get('ds_version', '?'))}",
        f"optimizer   {record[C.OPTIMIZER_CLASS_KEY]} (bnb update rule '{record[C.OPTIMIZER_NAME_KEY]}')",
        f"master      {ckpt.master_mode}: {MASTER_SAVED[ckpt.master_mode]}",
    ]
    if ckpt.model_parallel > 1:  # what follows is rank 0's share of the model
        lines.append(f"model       {ckpt.model_parallel} model-parallel ranks (tensor-parallel ranks x pipeline "
                     f"stages); below: rank 0's parameters only (`export --universal` joins them)")
    shapes = ckpt.param_shapes()
    for g, group in enumerate(ckpt.groups):
        parts = ckpt.parts(g)
        layout = parts[0].layout
        numels = [n for part in parts for n in part.layout.numels]
        eight_bit = [b for part in parts for b in part.eight_bit]
        hyper = ", ".join(f"{k}={v}" for k, v in sorted(group[C.HYPERPARAMS_KEY].items()) if k != "params")
        classes = ", ".join(f"{k}:{v}" for k, v in group[C.KEY_CLASSES_KEY].items())
        step = group[C.STATE_KEY].get("step")
        placed = f"{layout.dp} partitions of {layout.partition_size:,} elements" if len(parts) == 1 else \
            (f"expert group (DeepSpeed MoE): {len(parts)} expert-parallel ranks, each holding its experts in "
             f"{layout.dp} partition{'s' if layout.dp > 1 else ''} of {layout.partition_size:,} elements")
        lines += [
            f"param group {g}: {len(numels)} parameters, {sum(numels):,} elements "
            f"({sum(eight_bit)} with 8-bit state, {len(eight_bit) - sum(eight_bit)} fp32); step {step}",
            f"  hyper-parameters  {hyper}",
            f"  state keys        {classes}",
            f"  layout            {placed}, block-alignment padding {layout.padding_numel * len(parts):,}",
        ]
        for part in parts:
            if part.ep_rank is not None:
                lines.append(f"  expert-parallel rank {part.ep_rank}: rank files {list(part.files)}")
            for name, numel, is8 in zip(part.names, part.layout.numels, part.eight_bit):
                lines.append(f"    {'8-bit' if is8 else 'fp32 ':5}  {name}  {tuple(shapes[g][name])}  {numel:,}")
    lines.append("files")
    total = 0
    for name in sorted(os.listdir(ckpt.tag_dir)):
        size = os.path.getsize(os.path.join(ckpt.tag_dir, name))
        total += size
        lines.append(f"  {_size(size):>10}  {name}")
    lines.append(f"  {_size(total):>10}  total")
    return "\n".join(lines)
