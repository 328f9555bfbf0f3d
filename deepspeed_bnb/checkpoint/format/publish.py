"""Crash-safe publishing of a checkpoint tag: ranks write into a staging directory, one process publishes it whole.

Stock DeepSpeed writes each tag straight into `save_dir/<tag>/` and rank 0 rewrites `latest` as soon as its own
files are written, without waiting for the other ranks: a save killed midway can leave `latest` naming a partial
checkpoint, and re-saving an existing tag destroys it before the new one is complete. Here the ranks write into a
staging directory; once all are done, the files are hashed (shared between ranks), the manifest is written, and
one process publishes: the old tag directory steps aside, the staging directory takes its name, the old one is
deleted, and `latest` is replaced atomically. A save killed at any point leaves the previous checkpoint loadable;
`recover_tag` finishes the only non-atomic step (an overwrite interrupted between two renames) on the next load.

Writers never follow a link: whatever stands at a path they create or replace (a symbolic link planted at the
staging name, at `latest`, at an output file) is removed or renamed over, never written through; files are created
exclusively under temporary names and renamed into place. One save of a save directory runs at a time: the
publishing process holds an advisory lock (flock) on the directory while it saves, which the kernel drops if the
process dies; a second job saving into the directory fails at once naming the lock, instead of two writers
interleaving their renames. Where the file system cannot lock (some network file systems), saves go on without it, as
stock DeepSpeed's do, after a warning.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import warnings
from typing import Dict, Optional

from deepspeed_bnb.checkpoint.format.errors import CheckpointSaveError
from deepspeed_bnb.checkpoint.format.manifest import LATEST, MANIFEST_NAME, MANIFEST_VERSION, file_digest, list_files

STAGING_SUFFIX = ".deepspeed_bnb-partial"  # `.<tag>` + suffix: the tag being written
RETIRED_SUFFIX = ".deepspeed_bnb-retired"  # `.<tag>` + suffix: the previous version of a tag being replaced
_UNLOCKABLE = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)  # no flock on this file system
_warned_unlockable = set()


def staging_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}{STAGING_SUFFIX}")


def retired_dir(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}{RETIRED_SUFFIX}")


def remove(path: str) -> None:
    """Remove what stands at `path` without following a link: a link or file is unlinked, a directory removed with its
    contents (rmtree does not follow the links inside it either); nothing there is fine."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(path: str) -> str:
    """A new, empty regular file next to `path` (created exclusively, never through a link); the caller renames it
    onto `path` or removes it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):  # left by a writer of this pid that was killed
        remove(tmp)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    return tmp


@contextlib.contextmanager
def replacing(path: str):
    """Yields a temporary path beside `path` to write; when the block succeeds it is renamed onto `path` (replacing
    whatever stands there, a link included, never writing through it); when it fails it is removed."""
    tmp = temporary_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def write_json_atomic(path: str, payload) -> None:
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(payload if isinstance(payload, str) else json.dumps(payload, indent=1, sort_keys=True))
            f.flush()
            os.fsync(f.fileno())
    _fsync_dir(os.path.dirname(path) or ".")


def try_flock(fd: int) -> Optional[bool]:
    """Take an exclusive advisory lock (flock) on the open file `fd` without waiting: True once taken (closing `fd`
    drops it), False if another open file holds it (another process, or another descriptor of this one), None where
    the file system cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno not in _UNLOCKABLE:
            raise
        return None
    return True


class DirectoryLock:
    """An exclusive advisory lock (flock) on a directory, held by one process; the kernel releases it when the process
    exits, however it exits, so no stale lock outlives a killed save."""

    def __init__(self, directory: str):
        self.directory = directory
        self.fd: Optional[int] = None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (True); False if another process holds it. Where the file system has no locks,
        True after a one-time warning (nothing can be excluded there)."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            taken = try_flock(fd)
        except BaseException:
            os.close(fd)
            raise
        if taken:
            self.fd = fd
            return True
        os.close(fd)
        if taken is None and self.directory not in _warned_unlockable:
            _warned_unlockable.add(self.directory)
            warnings.warn(f"deepspeed_bnb: the file system of {self.directory} cannot lock it: two jobs saving into "
                          f"it at once would not be kept apart.", RuntimeWarning)
        return taken is not False

    def acquire_for_save(self, tag: str) -> None:
        if not self.try_acquire():
            raise CheckpointSaveError(
                f"another process is saving into {self.directory} right now (it holds the directory's lock), so tag "
                f"{tag!r} was not written: two jobs writing one checkpoint directory would replace each other's tags "
                f"midway. Give each job its own save directory, or save again once the other save has finished")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None


def publish(save_dir: str, tag: str, files: Dict[str, dict], description: dict, save_latest: bool) -> None:
    """Make the staged tag the real one (run by one process, after every rank finished writing)."""
    staged, final, retired = staging_dir(save_dir, tag), os.path.join(save_dir, tag), retired_dir(save_dir, tag)
    tag_dir = os.path.join(staged, tag)
    write_json_atomic(os.path.join(tag_dir, MANIFEST_NAME),
                      {"manifest_version": MANIFEST_VERSION, "tag": tag, "files": files, **description})
    for name in sorted(os.listdir(staged)):  # what DeepSpeed writes beside the tag (its zero_to_fp32.py script)
        if name != tag:
            os.replace(os.path.join(staged, name), os.path.join(save_dir, name))
    if os.path.lexists(final):
        remove(retired)
        os.rename(final, retired)  # from here until the next rename, recover_tag() can undo an interruption
    os.rename(tag_dir, final)
    _fsync_dir(save_dir)
    remove(retired)
    remove(staged)
    if save_latest:
        write_json_atomic(os.path.join(save_dir, LATEST), tag)


def recover_tag(load_dir: str, tag: str) -> None:
    """Undo a save killed between retiring the old tag directory and renaming the new one into place; nothing while
    another process holds the directory's lock (its save is in the middle of exactly those renames)."""
    final, retired = os.path.join(load_dir, tag), retired_dir(load_dir, tag)
    if os.path.lexists(final) or not os.path.isdir(retired) or os.path.islink(retired):
        return
    lock = DirectoryLock(load_dir)
    if not lock.try_acquire():
        return
    try:
        if not os.path.lexists(final):
            os.rename(retired, final)
    finally:
        lock.release()


def fresh_staging(save_dir: str, tag: str) -> str:
    """An empty staging tag directory for an offline writer (reshape, convert); publish_staged() finishes it,
    discard_staging() removes it after a failure."""
    staged = staging_dir(save_dir, tag)
    remove(staged)
    os.makedirs(os.path.join(staged, tag))
    return os.path.join(staged, tag)


def publish_staged(save_dir: str, tag: str, description: dict, save_latest: bool = True) -> str:
    """Hash every staged file (one process) and publish the tag; returns the final tag directory."""
    tag_dir = os.path.join(staging_dir(save_dir, tag), tag)
    files = {name: file_digest(os.path.join(tag_dir, name)) for name in list_files(tag_dir)}
    publish(save_dir, tag, files, description, save_latest)
    return os.path.join(save_dir, tag)


@contextlib.contextmanager
def offline_write(save_dir: str, tag: str):
    """The staging tag directory of an offline writer, under the save directory's lock: published by the block (with
    publish_staged), or removed when the block fails, so that a failed tool run leaves nothing behind."""
    os.makedirs(save_dir, exist_ok=True)
    lock = DirectoryLock(save_dir)
    lock.acquire_for_save(tag)
    try:
        staged = fresh_staging(save_dir, tag)
        try:
            yield staged
        except BaseException:
            remove(staging_dir(save_dir, tag))
            raise
    finally:
        lock.release()
