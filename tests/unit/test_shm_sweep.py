"""The session-end sweep of DeepSpeed's CPU comm buffers (deepspeed_bnb/utils/teardown.py: sweep_shm_buffers).

DeepSpeed's CPU comm op creates a 66 MB buffer per rank in /dev/shm and never unlinks it; finish() and the one-rank
fixture release theirs, and the suite sweeps at its end what a killed rank left. Checked with real files under the
op's naming: a buffer of this session that no process maps is removed; one a process maps (this one, here), one from
before the session (its time set back) and a file of another name are kept (controls).
"""

import mmap
import os
import time

import pytest

from deepspeed_bnb.utils.teardown import SHM_BUFFER, SHM_DIR, sweep_shm_buffers

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR) or not os.path.isdir("/proc"),
                                reason="no /dev/shm or /proc on this system")


@pytest.fixture
def buffers():
    made = []

    def make(kind):
        name = SHM_BUFFER.format(uid=os.getuid()) + f"sweeptest_{os.getpid()}_{kind}"
        if kind == "other":
            name = f"sweeptest_{os.getpid()}_not_a_comm_buffer"
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.truncate(4096)
        made.append(name)
        return name

    yield make
    for name in made:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def test_only_this_sessions_unmapped_buffers_are_removed(buffers):
    since = time.time()
    old, left, held, other = (buffers(kind) for kind in ("old", "left", "held", "other"))
    os.utime(os.path.join(SHM_DIR, old), (since - 600, since - 600))
    with open(os.path.join(SHM_DIR, held), "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapping:
        mapping[0] = 1
        removed = sweep_shm_buffers(since)  # (also any other run's leftover of this session, unmapped: garbage too)
    assert left in removed and not {old, held, other} & set(removed)
    assert not os.path.exists(os.path.join(SHM_DIR, left))
    assert all(os.path.exists(os.path.join(SHM_DIR, name)) for name in (old, held, other))
