"""Closed-form bytes per rank, by role, for ZeRO-1/2/3 with fp32 torch AdamW or bnb AdamW8bit (fp32 training).

Written from how the two layouts and DeepSpeed's gradient path work, not from deepspeed_bnb's code, so that the
measured points (scaling.py) check it. P_g: elements of param group g; b: reduce_bucket_size; all terms are
averages over the DP ranks (state of small tensors and partition edges differ a little from rank to rank).

  padded_g   stock ZeRO: P_g rounded up to 2*DP.  deepspeed_bnb: every tensor rounded up to a 256-element block,
             the group rounded up to 256*DP (block-aligned partitions).            N = sum_g padded_g
  weights    4*N              the fp32 model, replicated on every rank (ZeRO-1/2 do not partition it)
  master     4*N/DP           ZeRO's fp32 master partition
  state      torch AdamW: 8*N/DP + 4 per group (exp_avg, exp_avg_sq; a 4-byte `step` tensor)
             bnb 8-bit:   groups with tensors of >= 4096 elements: (2 + 2*4/256)*padded_g/DP (two uint8 codes per
                          element, two fp32 absmax per block) + 2*256*4 (two quantization maps, on every rank);
                          tensors below 4096 elements (bnb's min_8bit_size) keep fp32 state: 8*P_small/DP
  gradients  ZeRO-1: 4*P + 4*N/DP   the full fp32 gradient of backward (per tensor, unpadded: P = sum_g P_g)
                                    plus this rank's reduced partition copy, both alive at the end of backward
             ZeRO-2: 8*N/DP         the step holds the partition gradient and its flattened copy
             plus a transient of at most 4*(b + 2*largest tensor): gradients waiting for a bucket, and the whole
             gradients of the (up to two) tensors that straddle this rank's partition edges
  buckets    4*b              the reduction bucket buffer (fixed size, whatever the model)

ZeRO-3 partitions each tensor on its own: stock pads a tensor of n elements to a multiple of DP, deepspeed_bnb to a
multiple of 256*DP (every slice whole blocks).                                      N3 = sum over tensors of padded n
  weights    4*N3/DP + 4*P_persistent   this rank's slices, and the tensors below the persistence threshold kept whole
  master     4*N3/DP
  state      torch AdamW: 8*N3/DP + 4 per group;  bnb 8-bit: (2 + 2*4/256)*N3_8/DP for tensors >= 4096 elements
             (their padded sizes) + 2*256*4 per group with such tensors; smaller tensors 8*P_small/DP (fp32 state of
             the real elements only)
  gradients  8*N3/DP          the gradient partition buffer and the step's flattened copy of a sub-group
"""

from collections.abc import Sequence

BLOCK = 256
MIN_8BIT = 4096  # bnb's default min_8bit_size


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded(numels: Sequence[int], dp: int, optimizer: str) -> int:
    if optimizer == "bnb8":
        return round_up(sum(round_up(n, BLOCK) for n in numels), BLOCK * dp)
    return round_up(sum(numels), 2 * dp)


def state_bytes(groups: Sequence[Sequence[int]], dp: int, optimizer: str) -> float:
    if optimizer == "torch_adamw":
        return sum(8 * padded(g, dp, optimizer) / dp + 4 for g in groups)
    total = 0.0
    for g in groups:
        if any(n >= MIN_8BIT for n in g):
            total += (2 + 2 * 4 / BLOCK) * padded(g, dp, optimizer) / dp + 2 * 256 * 4
        total += 8 * sum(n for n in g if n < MIN_8BIT) / dp
    return total


PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (elements)


def padded3(numel: int, dp: int, optimizer: str) -> int:
    return round_up(numel, (BLOCK if optimizer == "bnb8" else 1) * dp)


def bytes_per_rank3(groups: Sequence[Sequence[int]], dp: int, optimizer: str, bucket: int) -> dict[str, float]:
    n3 = sum(padded3(n, dp, optimizer) for g in groups for n in g)
    if optimizer == "torch_adamw":
        state = 8 * n3 / dp + 4 * len(groups)
    else:
        state = sum((2 + 2 * 4 / BLOCK) * padded3(n, dp, optimizer) / dp if n >= MIN_8BIT else 8 * n / dp
                    for g in groups for n in g)
        state += 2 * 256 * 4 * sum(1 for g in groups if any(n >= MIN_8BIT for n in g))
    return {
        "weights": 4 * n3 / dp + 4 * sum(n for g in groups for n in g if n <= PERSISTENCE),
        "master": 4 * n3 / dp,
        "state": state,
        "gradients": 8 * n3 / dp,
        "buckets": 4 * bucket,
        "transient_bound": 4 * (bucket + 2 * max(max(g) for g in groups)),
    }


def bytes_per_rank(groups: Sequence[Sequence[int]], dp: int, stage: int, optimizer: str,
                   bucket: int) -> dict[str, float]:
    if stage == 3:
        return bytes_per_rank3(groups, dp, optimizer, bucket)
    n = sum(padded(g, dp, optimizer) for g in groups)
    p = sum(map(sum, groups))
    return {
        "weights": 4 * n,
        "master": 4 * n / dp,
        "state": state_bytes(groups, dp, optimizer),
        "gradients": 4 * p + 4 * n / dp if stage == 1 else 8 * n / dp,
        "buckets": 4 * bucket,
        "transient_bound": 4 * (bucket + 2 * max(max(g) for g in groups)),
    }
