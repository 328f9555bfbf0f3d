"""Expert-parallel param groups (DeepSpeed MoE) in records: global expert names, and which rank files hold them.

DeepSpeed's ZeRO-1/2 partitions an expert group (`moe: True`, from split_params_into_different_moe_groups_for_optimizer)
over its expert-data-parallel group, not over the data-parallel group: each of the E expert-parallel ranks holds other
experts, under the same local names (`...deepspeed_experts.0...` on every rank). A record of such a group therefore
names each expert by its global id (expert-parallel rank x local experts + local id, as DeepSpeed names the expert
weight files) and carries the placement: which DP rank's file holds which partition of which experts. A loader then
takes each of its parameters from the files that hold that expert, at any expert-data-parallel size and at any
expert-parallel size that regroups the same experts.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError

# DeepSpeed's MoE layer keeps its experts in `<layer>.deepspeed_moe.experts.deepspeed_experts.<local id>.<...>`
_EXPERT_NAME = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..*)?$")


@dataclass(frozen=True)
class ExpertPlacement:
    """Where an expert group's state lives, the same on every rank but for `ep_rank` and `edp_rank`."""

    group_name: str  # DeepSpeed's expert group name (the param group's 'name', e.g. "ep_size_2")
    ep_size: int  # expert-parallel ranks: each holds its own experts
    ep_rank: int  # this rank's expert-parallel rank (which experts it holds)
    edp_rank: int  # this rank's partition of them (its rank in the expert-data-parallel group)
    files: Tuple[Tuple[int, ...], ...]  # [expert-parallel rank][partition] -> the DP rank (rank file) holding it

    def to_dict(self) -> dict:
        return {"group_name": self.group_name, "ep_size": self.ep_size, "ep_rank": self.ep_rank,
                "edp_rank": self.edp_rank, "files": [list(ranks) for ranks in self.files]}


def placement_from_dict(data, dp: int, where: str) -> ExpertPlacement:
    """An ExpertPlacement read from a record of a checkpoint written by `dp` ranks: every count checked (the file is
    not trusted to be well formed), the table a partition of the ranks 0..dp-1 into equal expert-data-parallel
    groups."""
    def malformed(what):
        return CheckpointMismatchError(f"{where}: the expert placement {what}; the record is malformed (damaged or "
                                       f"crafted).")

    if not isinstance(data, dict) or not isinstance(data.get("group_name"), str):
        raise malformed("is not a dict with a group name")
    counts = [data.get(k) for k in ("ep_size", "ep_rank", "edp_rank")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise malformed("has counts that are not integers >= 0")
    files = data.get("files")
    if not isinstance(files, list) or len(files) != counts[0] or counts[0] < 1 or \
            not all(isinstance(ranks, list) and len(ranks) == dp // counts[0] for ranks in files) or \
            sorted(r for ranks in files for r in ranks) != list(range(dp)):
        raise malformed(f"does not split the {dp} rank files into {counts[0]} equal expert-data-parallel groups")
    if counts[1] >= counts[0] or counts[2] >= len(files[0]):
        raise malformed("names a rank outside its table")
    return ExpertPlacement(data["group_name"], counts[0], counts[1], counts[2], tuple(tuple(r) for r in files))


def local_expert_counts(names: Sequence[str]) -> Dict[str, int]:
    """Per MoE layer (its expert prefix): how many local experts a rank holds, from the model's parameter names."""
    ids: Dict[str, set] = {}
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match:
            ids.setdefault(match.group(1), set()).add(int(match.group(2)))
    return {prefix: len(found) for prefix, found in ids.items()}


def global_expert_names(names: Sequence[str], ep_rank: int, local_counts: Dict[str, int]) -> List[str]:
    """`names` with each local expert id replaced by its global id (ep_rank * local experts + local id), as DeepSpeed
    names the expert weight files; a parameter of no DeepSpeed MoE layer keeps its name (a custom expert module's
    parameters can then move between expert-data-parallel sizes, not between expert-parallel sizes)."""
    out = []
    for name in names:
        match = _EXPERT_NAME.match(name)
        if match and match.group(1) in local_counts:
            local = int(match.group(2))
            name = f"{match.group(1)}{ep_rank * local_counts[match.group(1)] + local}{match.group(3) or ''}"
        out.append(name)
    return out
