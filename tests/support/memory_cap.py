"""Caps a child process's address space at what its imports mapped plus a headroom, for tests that show an input
cannot drive an allocation: an absolute cap would fail the imports themselves with a CUDA build of torch, which maps
about 3 GiB where the CPU build maps 1 ("libtorch_cpu.so: failed to map segment from shared object")."""

import resource


def cap_above_imports(headroom: int) -> int:
    """Set RLIMIT_AS to this process's mapped size now plus `headroom` bytes; returns the cap."""
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom, mapped + headroom))
    return mapped + headroom
