"""Real text without a download: the Python standard library's own source files, as bytes, split train/validation."""

import glob
import os
import sysconfig

import torch


def stdlib_bytes(limit_bytes: int = 8 << 20) -> torch.Tensor:
    """Up to `limit_bytes` of the running interpreter's stdlib *.py files (sorted, so every rank reads the same)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path or "test" in os.path.relpath(path, root).split(os.sep)[0]:
            continue
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        size += len(data)
        if size >= limit_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"no Python sources found under the standard library at {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


class ByteBatches:
    """Random windows of the text: a rank's stream depends on (seed, rank) only; validation is the held-out tail."""

    def __init__(self, data: torch.Tensor, context: int, holdout: float = 0.05):
        split = int(len(data) * (1 - holdout))
        self.train, self.valid, self.context = data[:split], data[split:], context

    def sample(self, split: str, batch: int, generator: torch.Generator):
        data = self.train if split == "train" else self.valid
        starts = torch.randint(0, len(data) - self.context - 1, (batch,), generator=generator)
        x = torch.stack([data[s:s + self.context] for s in starts])
        y = torch.stack([data[s + 1:s + 1 + self.context] for s in starts])
        return x, y


class ByteWindows(torch.utils.data.Dataset):
    """`count` fixed windows of `context + 1` bytes (inputs plus the next byte): sample i is the same on any number of
    ranks, so a DataLoader split across ranks by Accelerate or HF Trainer gives the same global batches."""

    def __init__(self, data: torch.Tensor, context: int, count: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.data, self.context = data, context
        self.starts = torch.randint(0, len(data) - context - 1, (count,), generator=generator).tolist()

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, index):
        start = self.starts[index]
        return self.data[start:start + self.context + 1]
