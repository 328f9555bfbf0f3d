"""NVMe swapping of bitsandbytes optimizer state for ZeRO-3's `offload_optimizer: {"device": "nvme"}`.

DeepSpeed's optimizer swapper (deepspeed/runtime/swap_tensor/partitioned_optimizer_swapper.py) swaps each sub-group's
fp32 partition, its gradients and every optimizer-state tensor of 1 MiB or more into buffers of the partition's
numel and dtype (fp32). bnb's state is not that: uint8 codes of the partition's numel, fp32 absmax of 1/256 of it,
whole 256-entry maps. Swapped as fp32 moments, the codes are read back from files never written (a C++ assertion) or
into buffers four times their size. So the bnb ZeRO-3 optimizer hides its state from DeepSpeed's swapper, which
keeps the fp32 partition and the gradients, and swaps the state here, with DeepSpeed's async_io op: each
partitioned tensor (codes, absmax, fp32 moments of 32-bit parameters) to a file of its own per sub-group and key,
read back whole before the sub-group steps and written after. Whole tensors (the maps) and scalars stay in memory.

Two traps of the async_io op, measured with DeepSpeed 0.19.8 on this project's machines: a write whose size is not a
multiple of its alignment unit (1024 bytes) leaves an empty file and reports success, and a write to a full disk
leaves a short file and reports success too. Every write here is padded to the unit, and every file's size is checked
after it is written and before it is read: a short file raises NVMeSwapError naming the path, the bytes found and the
bytes expected, and the optimizer stops the run on every rank (runtime/zero/nvme_state.py).
"""

import os
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

ALIGNED_BYTES = 1024  # DeepSpeed's AIO_ALIGNED_BYTES: the unit every read and write is padded to (per I/O thread)


class NVMeSwapError(OSError):
    """A swap file could not be written or read whole."""


@dataclass
class SwapEntry:
    path: str  # the swap file
    shape: Tuple[int, ...]  # the tensor's shape in memory
    dtype: torch.dtype  # its dtype
    nbytes: int  # its size in bytes (the file holds it padded to the alignment unit)


def aio_handle(aio_config: dict):
    """An async_io handle of its own (DeepSpeed's swapper waits on its handle's whole queue: sharing it would mix
    their completions). Positional: the fifth argument was renamed (thread_count, then intra_op_parallelism)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    parallel = aio_config.get("intra_op_parallelism", aio_config.get("thread_count", 1))
    return AsyncIOBuilder().load(verbose=False).aio_handle(aio_config["block_size"], aio_config["queue_depth"],
                                                           aio_config["single_submit"], aio_config["overlap_events"],
                                                           parallel), parallel


class BnbStateSwapper:
    """The swap files of one rank's bnb state, per (sub-group, key)."""

    def __init__(self, folder: str, aio_config: dict):
        self.folder = folder  # this rank's folder of swap files
        os.makedirs(folder, exist_ok=True)
        self.handle, parallel = aio_handle(aio_config)
        self.unit = ALIGNED_BYTES * parallel  # every transfer is a multiple of this many bytes
        self.entries: Dict[Tuple[int, str], SwapEntry] = {}  # (sub-group, key) -> its file

    def _padded(self, nbytes: int) -> int:
        return -(-nbytes // self.unit) * self.unit

    def swapped(self, sub_group: int) -> bool:
        return any(sub == sub_group for sub, _ in self.entries)

    def swap_out(self, sub_group: int, tensors: Dict[str, torch.Tensor]) -> None:
        """Write each tensor to its file, then free its memory (the tensor object stays, empty, in the state). Raises
        NVMeSwapError, once every tensor is handled, if a file came out short."""
        problems = []
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            entry = self.entries.setdefault((sub_group, key), SwapEntry(
                os.path.join(self.folder, f"sub{sub_group}.{key}.swp"), tuple(tensor.shape), tensor.dtype, nbytes))
            buffer = torch.zeros(self._padded(nbytes), dtype=torch.uint8)
            buffer[:nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
            self.handle.sync_pwrite(buffer, entry.path)
            written = file_size(entry.path)
            if written != buffer.numel():
                problems.append(f"writing bnb optimizer state {key!r} of sub-group {sub_group} to {entry.path} "
                                f"stored {written} of {buffer.numel()} bytes")
            release(tensor)
        if problems:
            raise NVMeSwapError("; ".join(problems) + " (a full disk, or a folder that cannot be written)")

    def swap_in(self, sub_group: int, tensors: Dict[str, torch.Tensor]) -> None:
        """Read each tensor of the sub-group back into memory (the same tensor objects). A short or missing file (the
        async_io op would assert and abort the process) gives zeros instead, and NVMeSwapError once every tensor is
        handled: the caller stops the run on every rank."""
        problems = []
        for key, tensor in tensors.items():
            entry = self.entries[(sub_group, key)]
            padded = self._padded(entry.nbytes)
            buffer = torch.zeros(padded, dtype=torch.uint8)
            found = file_size(entry.path)
            if found < padded:
                problems.append(f"the swap file {entry.path} of bnb optimizer state {key!r} (sub-group {sub_group}) "
                                f"holds {found} bytes, {padded} expected")
            else:
                self.handle.sync_pread(buffer, entry.path)
            tensor.data = buffer[:entry.nbytes].view(entry.dtype).view(entry.shape)
        if problems:
            raise NVMeSwapError("; ".join(problems))


def release(tensor: torch.Tensor) -> None:
    """Free a swapped tensor's memory; the tensor object stays (empty) where the state holds it."""
    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def file_size(path: str) -> int:
    """Bytes in the file; 0 when it does not exist."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0
