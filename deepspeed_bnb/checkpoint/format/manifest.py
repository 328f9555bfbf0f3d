"""A tag's manifest: the files that make up the checkpoint, with their sizes and SHA-256 checksums (publish.py writes
it last, once every rank's files are complete), and the checks of a tag against it.

The manifest defines the checkpoint: a tag holds exactly the files it lists, as regular files inside the tag
directory (a file copied in afterwards, an entry removed, a symbolic link or a tag directory that is one, are all
refused before anything is read), and it lists the files its own description requires (model states and one
optimizer file per data-parallel rank). Manifest version 2 adds, per `.pt` file, the CRC-32 of every tensor in it
(integrity.py), so that a load that finds a file's SHA-256 wrong names the damaged tensor; version-1 manifests (no
per-tensor digests) are still read. Everything a manifest names is checked before use: a tag or file name that
would leave the checkpoint directory is refused, since the manifest and `latest` are as untrusted as the rest of a
downloaded checkpoint.
"""

import hashlib
import json
import os
from typing import Dict, Iterable, List, Optional, Tuple

from deepspeed_bnb.checkpoint.format.constants import FORMAT_VERSION, MODEL_STATES, RANK_FILE, STAGE3_MODEL_STATES
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError, UnsafeCheckpointError
from deepspeed_bnb.checkpoint.format.integrity import damaged_tensors, tensor_checksums
from deepspeed_bnb.checkpoint.format.safe_load import load_file

MANIFEST_NAME = "deepspeed_bnb_manifest.json"
LATEST = "latest"  # DeepSpeed's pointer to the newest tag of a checkpoint directory
LATEST_UNIVERSAL = "latest_universal"  # ... and to the tag of a universal checkpoint (engines with load_universal)
MANIFEST_VERSION = 2
READABLE_MANIFEST_VERSIONS = (1, 2)
TENSORS_KEY = "tensors"  # per file entry (version 2, `.pt` files): tensor path -> CRC-32 (integrity.py)
UNSAFE_KEY = "needs_trust"  # per file entry: why the file does not load through the safe loader (it was saved so)
_CHUNK = 8 << 20


def file_digest(path: str) -> Dict[str, object]:
    """Size and SHA-256 of a file, and for a torch file the CRC-32 of each tensor in it (read back through the safe
    loader, which also proves it loads without trust); flushes the file to stable storage (the publishing rename
    must not outrun it)."""
    size, sha256 = _hash(path, flush=True)
    entry = {"bytes": size, "sha256": sha256}
    if path.endswith(".pt"):
        try:
            entry[TENSORS_KEY] = tensor_checksums(load_file(path, mmap=True))
        except UnsafeCheckpointError as exc:
            entry[UNSAFE_KEY] = str(exc).split(" to load,")[0]
    return entry


def safe_name(name: str, source: str, what: str, one_component: bool = False) -> str:
    """`name` when it is a plain relative path inside a directory (no '..', not absolute, no control characters;
    a single directory name if `one_component`); otherwise an error naming `source`, since the name came from a file
    that could have been tampered with."""
    parts = name.replace("\\", "/").split("/")
    if not name or len(name) > 4096 or os.path.isabs(name) or any(p in ("", ".", "..") for p in parts) or \
            any(ord(c) < 32 or c == "\ufffd" for c in name) or (one_component and len(parts) > 1):
        raise CheckpointMismatchError(f"{source} names the {what} {name[:200]!r}, which is not a plain name inside "
                                      f"the checkpoint directory; the file is damaged or was tampered with. Fix it "
                                      f"or load another checkpoint.")
    return name


def list_files(root: str) -> List[str]:
    """Paths under `root`, relative and sorted (the same list on every rank: hashing is shared by index)."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


def read_pointer(directory: str, name: str = LATEST) -> Optional[str]:
    """The tag a pointer file (`latest`, `latest_universal`) names, read as DeepSpeed reads it (whitespace stripped, at
    most 4 KiB), or None without one. Not checked: see `pointer_tag`."""
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return f.read(4097).decode("utf-8", errors="replace").strip()


def pointer_tag(directory: str, name: str = LATEST) -> Optional[str]:
    """The tag a pointer file names, checked to be a plain directory name inside `directory`; None without one."""
    tag = read_pointer(directory, name)
    return None if tag is None else safe_name(tag, os.path.join(directory, name), "tag", one_component=True)


def latest_tag(save_dir: str) -> Optional[str]:
    """The tag `latest` names in a checkpoint directory, or None without one."""
    return pointer_tag(save_dir, LATEST)


def read_manifest(tag_dir: str) -> Optional[dict]:
    path = os.path.join(tag_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointMismatchError(f"{path} is not valid JSON ({exc}); the manifest is damaged, so the files of "
                                      f"this tag cannot be verified. Restore it from the source of the checkpoint, "
                                      f"or load another tag.") from exc
    if not isinstance(manifest, dict):
        raise CheckpointMismatchError(f"{path} holds a JSON {type(manifest).__name__}, not a deepspeed_bnb manifest "
                                      f"(an object); restore it, or load another tag.")
    if manifest.get("manifest_version") not in READABLE_MANIFEST_VERSIONS:
        raise CheckpointMismatchError(f"{path} has manifest version {manifest.get('manifest_version')!r}; this "
                                      f"deepspeed_bnb reads versions {READABLE_MANIFEST_VERSIONS}. Upgrade "
                                      f"deepspeed_bnb.")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise CheckpointMismatchError(f"{path} has no valid 'files' table (name -> bytes, sha256); the manifest is "
                                      f"damaged. Restore it from the source of the checkpoint, or load another tag.")
    for name in files:
        safe_name(name, path, "file")
    return manifest


def verify(tag_dir: str, manifest: dict, checksum: Iterable[str] = ()) -> None:
    """The tag holds exactly the files the manifest lists (no others, no links) with their sizes, and the files the
    manifest's description requires; the files in `checksum` (relative paths) also match their SHA-256 and, torch
    files, load through the safe loader (a manifest matching a planted file proves nothing: whoever planted it could
    rewrite the manifest; the pickle is parsed, the tensors stay on disk)."""
    listed = manifest["files"]
    present = tag_files(tag_dir)
    unlisted = sorted(set(present) - set(listed))
    if unlisted:
        shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
        raise CheckpointMismatchError(
            f"{tag_dir} holds {shown}, which its manifest ({MANIFEST_NAME}) does not list: the file was added after "
            f"the save (copied in from another checkpoint?) or its entry was removed. deepspeed_bnb reads only a "
            f"checkpoint's listed files and refuses a tag with others; remove the file, or load another tag.")
    missing = [name for name in required_files(manifest, tag_dir) if name not in listed]
    if missing:
        raise CheckpointMismatchError(
            f"{os.path.join(tag_dir, MANIFEST_NAME)} does not list {', '.join(missing[:5])}, which a checkpoint of "
            f"its own description (ZeRO stage {manifest.get('zero_stage')}, {manifest.get('dp_world_size')} "
            f"data-parallel ranks) consists of: the manifest was edited. Restore it, or load another tag.")
    for name, expected in listed.items():
        path = os.path.join(tag_dir, name)
        if name not in present:
            raise CheckpointMismatchError(f"{path} is missing; the checkpoint's manifest lists it.")
        size = present[name]
        if size != expected["bytes"]:
            raise CheckpointMismatchError(f"{path} has {size} bytes, the manifest says {expected['bytes']}: the file "
                                          f"is truncated or was replaced.")
    for name in checksum:
        path = os.path.join(tag_dir, name)
        if name not in listed:
            raise CheckpointMismatchError(f"{path} is not listed in the checkpoint's manifest ({MANIFEST_NAME}).")
        actual = _hash(path)[1]
        if actual != listed[name]["sha256"]:
            expected = listed[name]["sha256"]
            raise CheckpointMismatchError(f"{path} fails its SHA-256 check (manifest {expected}, file {actual}): the "
                                          f"file is corrupted{_where_damaged(path, listed[name])}. Restore it from "
                                          f"the source of the checkpoint, or load another tag.")
        if name.endswith(".pt"):
            load_file(path)


def tag_files(tag_dir: str) -> Dict[str, int]:
    """Relative path -> size of every file under a tag directory (the manifest itself excluded), walked without
    following links; a symbolic link, or anything but a directory or regular file, is an error naming it (a link
    would let the checkpoint read files outside itself)."""
    if os.path.islink(tag_dir):
        raise CheckpointMismatchError(
            f"{tag_dir} is a symbolic link (to {os.readlink(tag_dir)}): a checkpoint's tag must be a directory inside "
            f"it, not a pointer to files elsewhere. Copy the target in its place (cp -rL), or load another tag.")
    found, pending = {}, [""]
    while pending:
        relative = pending.pop()
        with os.scandir(os.path.join(tag_dir, relative)) as entries:
            for entry in entries:
                name = os.path.join(relative, entry.name)
                if entry.is_symlink():
                    raise CheckpointMismatchError(
                        f"{entry.path} is a symbolic link (to {os.readlink(entry.path)}): every file of a checkpoint "
                        f"must be a regular file inside it. Replace the link by a copy of its target, or load "
                        f"another tag.")
                if entry.is_dir():
                    pending.append(name)
                elif entry.is_file():
                    if name != MANIFEST_NAME:
                        found[name] = entry.stat().st_size
                else:
                    raise CheckpointMismatchError(f"{entry.path} is not a regular file (a device, pipe or socket); "
                                                  f"a checkpoint holds files only: refused.")
    return found


def required_files(manifest: dict, tag_dir: str = "") -> List[str]:
    """The files a tag of the manifest's description consists of: the model states and one optimizer file per rank
    of `dp_world_size` (ZeRO-3: one model-states file per rank), or a universal checkpoint's two entry files. The
    description is checked first: its counts bound what is asked of the file system."""
    where = os.path.join(tag_dir, MANIFEST_NAME)
    if manifest.get("universal"):
        return ["zero/optimizer_state.pt", MODEL_STATES]
    stage, dp = manifest.get("zero_stage"), manifest.get("dp_world_size")
    if stage is None and dp is None:  # no description (hand-made): nothing more to require
        return []
    if stage not in (1, 2, 3) or isinstance(dp, bool) or not isinstance(dp, int) or not 1 <= dp <= len(
            manifest["files"]):
        raise CheckpointMismatchError(f"{where} describes ZeRO stage {stage!r} at {dp!r} data-parallel ranks, which "
                                      f"its {len(manifest['files'])} files cannot be: the manifest is damaged or "
                                      f"crafted. Restore it, or load another tag.")
    bf16 = any(name.startswith("bf16_zero_pp_rank_") for name in manifest["files"])
    optimizer = [RANK_FILE.format("bf16_" if bf16 else "", r, 0) for r in range(dp)]
    model = [STAGE3_MODEL_STATES.format(r) for r in range(dp)] if stage == 3 else [MODEL_STATES]
    return model + optimizer


def _hash(path: str, flush: bool = False) -> Tuple[int, str]:
    """(bytes, SHA-256 hex) of a file, read in chunks; `flush`: also fsync it (a writer's, before publishing)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        if flush:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _where_damaged(path: str, entry: dict) -> str:
    """Which tensors of a file that failed its SHA-256 differ from their save-time CRC-32 (manifest version 2)."""
    if TENSORS_KEY not in entry:
        return " (this manifest has no per-tensor checksums to say where: `deepspeed-bnb migrate` adds them)"
    names, unreadable = damaged_tensors(path, entry[TENSORS_KEY])
    if unreadable:
        return f" and no longer loads ({unreadable})"
    if not names:
        return " outside its tensor data (the pickled structure or the zip directory)"
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return f": tensor data of {shown} changed since the save"


def describe(optimizer_class: str, zero_stage: int, dp: int, groups, master_mode: str = "fp32") -> dict:
    """The manifest's description of a run: `groups` yields (param_names, numels, eight_bit) per param group;
    `master_mode`: its master weights ("fp32", "bf16", "bf16+8")."""
    return {"deepspeed_bnb_format": FORMAT_VERSION, "optimizer_class": optimizer_class, "zero_stage": zero_stage,
            "dp_world_size": dp, "master_weights": master_mode,
            "groups": [{"param_names": list(names), "numels": list(numels), "eight_bit": list(eight_bit)}
                       for names, numels, eight_bit in groups]}

