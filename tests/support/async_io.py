"""Whether DeepSpeed's NVMe offload can run on this machine: its swappers on CPU ranks and its async_io op (libaio);
why not, for a skip that names what to install."""

import os

import pytest

from support.release_limits import FIRST_CPU_SWAPPING, NO_CPU_SWAPPING

LIBAIO_HEADER = "/usr/include/libaio.h"  # where libaio-dev puts its header on Debian/Ubuntu


def aio_missing():
    """Why NVMe offload cannot run here, or None: this DeepSpeed's swappers cannot run on CPU ranks
    (support/release_limits.py), or its async_io op cannot be built."""
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder
    from packaging.version import Version
    if Version(Version(deepspeed.__version__).base_version) < Version(FIRST_CPU_SWAPPING):
        return f"DeepSpeed {deepspeed.__version__}'s {NO_CPU_SWAPPING}"
    if not AsyncIOBuilder().is_compatible(verbose=False):
        if os.path.isfile(LIBAIO_HEADER):  # the builder's own compile-and-link check failed
            return (f"DeepSpeed {deepspeed.__version__}'s async_io builder finds no usable libaio although "
                    f"{LIBAIO_HEADER} is installed (its check compiles and links a call of io_submit): see "
                    f"`python -c 'from deepspeed.ops.op_builder import AsyncIOBuilder as B; "
                    f"B().is_compatible(verbose=True)'`")
        return ("NVMe offload needs DeepSpeed's async_io op, which needs libaio's headers and library: install them "
                "(Debian/Ubuntu: `apt-get install libaio-dev`; `make test` does so when run as root), then rerun")
    return None


def require_aio() -> None:
    missing = aio_missing()
    if missing:
        pytest.skip(missing)
