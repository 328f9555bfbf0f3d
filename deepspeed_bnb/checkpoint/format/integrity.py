"""Per-tensor checksums of a checkpoint file: recorded in the manifest at save, naming the tensor a damaged file lost.

The manifest's SHA-256 of a whole file says *that* a file changed; on a mismatch the loader re-reads the file (through
the safe loader) and compares each tensor's CRC-32 with the one recorded at save, so the error names the tensor
(`optimizer_state_dict/base_optimizer_state/groups/0/state/state1`), or says the damage lies outside tensor data
(the pickled structure, the zip directory). CRC-32 is enough to locate damage (the SHA-256 is the check itself) and
costs about a quarter of it.
"""

import zlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from deepspeed_bnb.checkpoint.format.safe_load import load_file

CHECKSUM = "crc32"  # algorithm of the per-tensor digests (hex, 8 digits)


def iter_tensors(value, prefix: str = "") -> Iterator[Tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor reachable through dicts, lists and tuples; paths join keys with '/'."""
    if torch.is_tensor(value):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from iter_tensors(item, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from iter_tensors(item, f"{prefix}/{i}" if prefix else str(i))


def tensor_checksum(tensor: torch.Tensor) -> str:
    """CRC-32 of a tensor's elements as stored (row-major bytes of its dtype)."""
    data = tensor.detach().reshape(-1).contiguous()
    if data.numel() == 0:
        return f"{0:08x}"
    return f"{zlib.crc32(memoryview(data.view(torch.uint8).numpy())):08x}"


def tensor_checksums(obj) -> Dict[str, str]:
    """Path -> checksum of every tensor in a loaded checkpoint object."""
    return {path: tensor_checksum(tensor) for path, tensor in iter_tensors(obj)}


def damaged_tensors(path: str, expected: Dict[str, str]) -> Tuple[List[str], Optional[str]]:
    """Tensors of the file at `path` whose checksum differs from `expected` (or that are missing), and, when the
    file cannot even be read, why."""
    try:
        obj = load_file(path, mmap=True)
    except Exception as exc:  # damage in the pickle or the zip directory: the tensors cannot be named
        return [], f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    actual = tensor_checksums(obj)
    return [name for name, digest in expected.items() if actual.get(name) != digest], None
