"""Expert groups (DeepSpeed MoE) of a ZeRO-1/2 optimizer: where each rank's experts live, and their global names.

DeepSpeed partitions an expert param group over its expert-data-parallel group (`real_dp_process_group[i]`), and every
expert-parallel rank holds other experts under the same local names. The records name them globally and say which
rank file holds which partition (checkpoint/format/experts.py), so that a load at another DP size finds them.
"""

from typing import List, Optional

from deepspeed import comm as dist
from deepspeed.utils import groups

from deepspeed_bnb.checkpoint.format.experts import ExpertPlacement, global_expert_names, local_expert_counts
from deepspeed_bnb.runtime.zero.compat import all_gather_object


def expert_placements(optimizer) -> List[Optional[ExpertPlacement]]:
    """Per param group of a DeepSpeedZeroOptimizer: its ExpertPlacement, or None. A collective over the data-parallel
    group when the model has expert groups (every rank tells which experts and partition it holds)."""
    names = [group.get("name") if group.get("moe") else None for group in optimizer.optimizer.param_groups]
    if not any(names):
        return [None] * len(names)
    mine = {i: (groups._get_expert_parallel_rank(name), dist.get_rank(group=optimizer.real_dp_process_group[i]))
            for i, name in enumerate(names) if name}
    everyone = [None] * dist.get_world_size(group=optimizer.dp_process_group)
    all_gather_object(everyone, mine, group=optimizer.dp_process_group)
    placements = []
    for i, name in enumerate(names):
        if not name:
            placements.append(None)
            continue
        ep_size = groups._get_expert_parallel_world_size(name)
        files = [[None] * (len(everyone) // ep_size) for _ in range(ep_size)]
        for dp_rank, held in enumerate(everyone):
            ep_rank, edp_rank = held[i]
            files[ep_rank][edp_rank] = dp_rank
        placements.append(ExpertPlacement(name, ep_size, *mine[i], tuple(tuple(ranks) for ranks in files)))
    return placements


def record_names(optimizer, i: int, placement: Optional[ExpertPlacement]) -> List[str]:
    """The names param group i's record gives its parameters: the model's, with global expert ids in an expert
    group."""
    names = [optimizer.param_names[p] for p in optimizer.bnb_flat_params(i)]
    if placement is None:
        return names
    return global_expert_names(names, placement.ep_rank, local_expert_counts(optimizer.param_names.values()))
