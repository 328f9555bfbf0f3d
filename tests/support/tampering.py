"""How the trust-boundary tests tamper with a checkpoint, as an attacker who can write its files would: a pickled
payload, a file rewritten with its manifest entry made to match, a copy to tamper with, a two-rank checkpoint."""

import hashlib
import json
import os
import shutil

import torch

from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME


class Payload:
    """Pickles as a call of os.system touching `marker`: what a malicious checkpoint carries (its file appearing is
    the proof the payload ran)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def copy_of(source, tmp_path, name="ckpt") -> str:
    folder = str(tmp_path / name)
    shutil.copytree(source, folder, symlinks=True)
    return folder


def rehash(tag_dir, name):
    """The manifest entry of `name` (relative to the tag) rewritten to match the file: the attacker controls the
    manifest too."""
    path = os.path.join(tag_dir, MANIFEST_NAME)
    with open(path) as f:
        manifest = json.load(f)
    with open(os.path.join(tag_dir, name), "rb") as f:
        data = f.read()
    entry = manifest["files"].setdefault(name, {})
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    entry.pop("tensors", None)
    with open(path, "w") as f:
        json.dump(manifest, f)


def rewrite(tag_dir, name, change):
    """Load a file of the tag in full, let `change` alter it (or return a replacement), save it and rehash it."""
    path = os.path.join(tag_dir, name)
    blob = torch.load(path, weights_only=False)
    blob = change(blob) or blob
    torch.save(blob, path)
    rehash(tag_dir, name)


def plant(tag_dir, name, marker):
    """A payload in file `name`, under the entry every loader reads (its DeepSpeed version)."""
    rewrite(tag_dir, name, lambda blob: blob.update(ds_version=Payload(marker)))


def two_rank_checkpoint(root: str, tag: str = "t"):
    """A checkpoint of 2 data-parallel ranks (a 1-rank save of the toy model reshaped offline) under root/dp2, and the
    engine state it holds."""
    from deepspeed_bnb.checkpoint.tools.reshape import reshape
    from support.fault_injection import engine_state
    from support.toy import MIN_8BIT_SIZE, build_engine, train_steps
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(2))
    engine.save_checkpoint(os.path.join(root, "dp1"), tag=tag)
    reshape(os.path.join(root, "dp1"), os.path.join(root, "dp2"), 2, progress=False)
    return os.path.join(root, "dp2"), engine_state(engine)
