"""The advisory locks that keep two jobs apart (checkpoint/format/publish.py): `try_flock` and `DirectoryLock`, which
saves take on their save directory and loads through a scratch folder take on that folder (runtime/converted_load.py).

Reference: the kernel's own flock on a second open file of the same directory (as another process holds it). Controls:
a free directory is taken, and is free again once released; a file system without flock (ENOLCK, as some network
file systems answer) lets a save go on after one warning naming the directory, while any other error is raised.
"""

import errno
import fcntl
import os
import warnings

import pytest

from deepspeed_bnb.checkpoint.format import publish


def _held_elsewhere(directory):
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    assert publish.try_flock(fd) is True
    return fd


def test_a_held_directory_is_refused_and_a_released_one_taken(tmp_path):
    other = _held_elsewhere(str(tmp_path))
    lock = publish.DirectoryLock(str(tmp_path))
    try:
        assert lock.try_acquire() is False and lock.fd is None
        with pytest.raises(publish.CheckpointSaveError, match=rf"another process is saving into {tmp_path}"):
            lock.acquire_for_save("global_step1")
    finally:
        os.close(other)
    assert lock.try_acquire() is True and lock.fd is not None  # control: free once the other lets go
    probe = os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert publish.try_flock(probe) is False  # held by `lock` now
    finally:
        os.close(probe)
    lock.release()
    assert lock.fd is None and lock.try_acquire() is True
    lock.release()


def test_a_file_system_without_locks_warns_once_and_goes_on(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(publish, "_warned_unlockable", set())
    fd = os.open(str(tmp_path), os.O_RDONLY)
    try:
        assert publish.try_flock(fd) is None
    finally:
        os.close(fd)
    with pytest.warns(RuntimeWarning, match=rf"the file system of {tmp_path} cannot lock it"):
        assert publish.DirectoryLock(str(tmp_path)).try_acquire() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert publish.DirectoryLock(str(tmp_path)).try_acquire() is True  # the warning is not repeated


def test_other_lock_errors_are_raised(tmp_path, monkeypatch):
    def denied(fd, operation):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(fcntl, "flock", denied)
    with pytest.raises(PermissionError):
        publish.DirectoryLock(str(tmp_path)).try_acquire()
