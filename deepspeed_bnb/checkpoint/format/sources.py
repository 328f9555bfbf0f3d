"""Where per-rank optimizer states come from when loading: the files of a tag on disk.

Loading at a new DP size needs the files of the old ranks that overlap the new partition (and rank 0's, which holds
the whole tensors), not every file: files are opened lazily and memory-mapped, and a missing or unreadable file is an
error that names it.
"""

import os
from typing import Callable, Dict, List

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.safe_load import load_file

OPTIMIZER_STATE_DICT = "optimizer_state_dict"  # DeepSpeed's key for the ZeRO optimizer's state in a rank file


class FileSource:
    """The per-rank files of one checkpoint tag, opened on first use (memory-mapped) and kept open."""

    def __init__(self, paths: List[str]):
        self.paths = list(paths)
        self.dp = len(self.paths)
        self._cache: Dict[int, dict] = {}

    def name(self, rank: int) -> str:
        return self.paths[rank]

    def state(self, rank: int) -> dict:
        return self.blob(rank)[OPTIMIZER_STATE_DICT]

    def blob(self, rank: int) -> dict:
        """The whole file: DeepSpeed stores the optimizer state beside its config and version."""
        if rank not in self._cache:
            path = self.paths[rank]
            if not os.path.isfile(path):
                raise CheckpointMismatchError(f"{path} is missing: the checkpoint was written by {self.dp} "
                                              f"data-parallel ranks and this file holds rank {rank}'s share.")
            blob = load_file(path)  # names the file in any error
            if not isinstance(blob, dict) or not isinstance(blob.get(OPTIMIZER_STATE_DICT), dict):
                raise CheckpointMismatchError(f"{path} is not a DeepSpeed ZeRO optimizer file "
                                              f"(no '{OPTIMIZER_STATE_DICT}' dict).")
            self._cache[rank] = blob
        return self._cache[rank]


def rank_file_paths(name_of: Callable[[int, bool], str], dp: int, prefer_bf16: bool) -> List[str]:
    """The per-rank file names of a tag: DeepSpeed prefixes them with 'bf16_' when saved in bf16 mode.

    `name_of(dp_rank, bf16_mode)` is the engine's own naming; the variant whose rank-0 file exists wins, so an fp32
    checkpoint loads into a bf16 engine and back.
    """
    for bf16_mode in (prefer_bf16, not prefer_bf16):
        paths = [name_of(rank, bf16_mode) for rank in range(dp)]
        if os.path.isfile(paths[0]):
            return paths
    return [name_of(rank, prefer_bf16) for rank in range(dp)]
