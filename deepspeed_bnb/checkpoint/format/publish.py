"""Crash-safe publishing of a checkpoint tag: ranks write into a staging directory, one rank publishes it whole.

Stock DeepSpeed writes each tag straight into `save_dir/<tag>/` and rank 0 rewrites `latest` as soon as its own
files are written, without waiting for the other ranks: a save killed midway can leave `latest` naming a partial
checkpoint, and re-saving an existing tag destroys it before the new one is complete. Here the ranks write into a
staging directory; once all are done, the files are hashed (shared between ranks), the manifest is written, and
one rank publishes: the old tag directory steps aside, the staging directory takes its name, the old one is deleted,
and `latest` is replaced atomically. A save killed at any point leaves the previous checkpoint loadable;
`recover_tag` finishes the only non-atomic step (an overwrite interrupted between two renames) on the next load.
"""

import json
import os
import shutil
from typing import Dict

from deepspeed_bnb.checkpoint.format.manifest import MANIFEST_NAME, MANIFEST_VERSION, file_digest, list_files

STAGING_SUFFIX = ".deepspeed_bnb-partial"  # `.<tag>` + suffix: the tag being written


RETIRED_SUFFIX = ".deepspeed_bnb-retired"  # `.<tag>` + suffix: the previous version of a tag being replaced


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}{STAGING_SUFFIX}")


def retired_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}{RETIRED_SUFFIX}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, payload) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(payload if isinstance(payload, str) else json.dumps(payload, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def publish(save_dir: str, tag: str, files: Dict[str, dict], description: dict, save_latest: bool) -> None:
    """Make the staged tag the real one (run by one rank, after every rank finished writing)."""
    staged, final, retired = staging_dir(save_dir, tag), os.path.join(save_dir, tag), retired_dir(save_dir, tag)
    tag_dir = os.path.join(staged, tag)
    write_json_atomic(os.path.join(tag_dir, MANIFEST_NAME),
                      {"manifest_version": MANIFEST_VERSION, "tag": tag, "files": files, **description})
    for name in os.listdir(staged):  # what DeepSpeed writes beside the tag (its zero_to_fp32.py script)
        if name != tag:
            os.replace(os.path.join(staged, name), os.path.join(save_dir, name))
    if os.path.isdir(final):
        shutil.rmtree(retired, ignore_errors=True)
        os.rename(final, retired)  # from here until the next rename, recover_tag() can undo an interruption
    os.rename(tag_dir, final)
    _fsync_dir(save_dir)
    shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    if save_latest:
        write_json_atomic(os.path.join(save_dir, "latest"), tag)


def recover_tag(load_dir: str, tag: str) -> None:
    """Undo a save killed between retiring the old tag directory and renaming the new one into place."""
    final, retired = os.path.join(load_dir, tag), retired_dir(load_dir, tag)
    if not os.path.isdir(final) and os.path.isdir(retired):
        os.rename(retired, final)


def fresh_staging(save_dir: str, tag: str) -> str:
    """An empty staging tag directory for an offline writer (reshape, convert); publish_staged() finishes it."""
    staged = staging_dir(save_dir, tag)
    shutil.rmtree(staged, ignore_errors=True)
    os.makedirs(os.path.join(staged, tag))
    return os.path.join(staged, tag)


def publish_staged(save_dir: str, tag: str, description: dict, save_latest: bool = True) -> str:
    """Hash every staged file (one process) and publish the tag; returns the final tag directory."""
    tag_dir = os.path.join(staging_dir(save_dir, tag), tag)
    files = {name: file_digest(os.path.join(tag_dir, name)) for name in list_files(tag_dir)}
    publish(save_dir, tag, files, description, save_latest)
    return os.path.join(save_dir, tag)
