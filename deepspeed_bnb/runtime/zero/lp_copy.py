"""The model's copy of the updated weights, written by the fused CPU kernel in place of DeepSpeed's pass after the step.

DeepSpeed's ZeRO-1/2 step (0.16-0.19) converts each updated fp32 master partition to the model's dtype in a pass of its
own, right after the optimizer: `bit16_partition_buffer.data.copy_(fp32_partition.data)` into the pinned buffer it then
sends to the device when the optimizer is offloaded (0.17 on), `bit16_partitions[rank].data.copy_(fp32_partition.data)`
into the model's flat buffer otherwise. That reads the whole partition again and writes it (6 bytes per element for a
bf16 model, beside the 8-bit step's 16). Where the partition lives on the CPU, the fused kernel writes that copy itself
from the block it has just updated (the operators' `lp_params`), and DeepSpeed's statement becomes a no-op. For the
statement, the group's entry of `single_partition_of_fp32_groups` is the copy's own tensor (torch's `copy_` of a tensor
onto the same data returns at once), and it is handed back before `step()` returns (`LpCopies.restore`, from
BnbZeroOptimizer.step's `finally`). Between the two, DeepSpeed's step reads that entry only in the copy statement
(checked in the steps of 0.16.4, 0.17.1, 0.18.3 and 0.19.8).

The bits are the same: the kernel rounds to nearest even as torch's conversion does (a NaN is stored as 0x7FC0, where
torch's vector loop writes 0xFFFF), and torch copies the segments bitsandbytes steps itself after its update.
DeepSpeed copies as before:
- on a GPU (the CUDA kernels do not write the copy);
- with bf16 or compensated master weights (the first are the model's copy already, the second hold error terms);
- for an fp16 model;
- under DeepSpeed 0.16's offload, which has no pinned buffer and sends the fp32 partition itself;
- for a partition the kernel steps no segment of;
- at a group's first step after the engine is built or a checkpoint is loaded. DeepSpeed's whole copy then also writes
  the alignment padding, which the kernel never touches; it stays zero in the master weights after that.
DEEPSPEED_BNB_KERNEL_LP_COPY=0 leaves every copy to DeepSpeed (a setting for comparing the two).
"""

import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Set

import torch
from deepspeed import comm as dist

ENV = "DEEPSPEED_BNB_KERNEL_LP_COPY"
COPY_DTYPES = (torch.float32, torch.bfloat16)  # the model dtypes the CPU kernels write (fp16: DeepSpeed copies)


def enabled() -> bool:
    """Whether the fused CPU kernel may write the model's copy (DEEPSPEED_BNB_KERNEL_LP_COPY, default 1)."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: use 1 (the fused CPU kernel writes the model's copy of the updated "
                         f"weights, the default) or 0 (DeepSpeed converts the partition after the step)")
    return value == "1"


def copy_tensor(optimizer, i: int) -> Optional[torch.Tensor]:
    """The tensor DeepSpeed's step copies group `i`'s updated fp32 master partition into, where the kernel can write
    it instead (on the CPU, fp32 or bf16, the partition's size); else None."""
    partition = optimizer.single_partition_of_fp32_groups[i]
    if partition.device.type != "cpu" or partition.dtype != torch.float32 or optimizer.bnb_master_errors[i] is not None:
        return None
    if optimizer.cpu_offload:
        buffers = getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None)  # DeepSpeed >= 0.17
        if not buffers:
            return None
        copy = buffers[i]
    else:
        copy = optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(group=optimizer.real_dp_process_group[i])]
    if (copy.device.type != "cpu" or copy.dtype not in COPY_DTYPES or copy.numel() != partition.numel()
            or not copy.is_contiguous()):
        return None
    return copy


@dataclass
class LpCopies:
    """One ZeRO-1/2 optimizer's model copies written by the kernel: which groups DeepSpeed has copied whole, and the
    master partitions handed out during a step."""

    # groups DeepSpeed has copied whole (padding included) since the engine was built or a checkpoint loaded
    whole: Set[int] = field(default_factory=set)
    # group -> its fp32 master partition, while single_partition_of_fp32_groups holds the copy in its place
    handed: Dict[int, torch.Tensor] = field(default_factory=dict)

    def target(self, optimizer, i: int) -> Optional[torch.Tensor]:
        """Where the kernel writes group `i`'s copy at this step; None: DeepSpeed copies (see the module docstring)."""
        if not enabled():
            return None
        copy = copy_tensor(optimizer, i)
        if copy is None or i in self.whole:
            return copy
        self.whole.add(i)  # this step DeepSpeed copies the whole partition
        return None

    def hand_over(self, optimizer, i: int, copy: torch.Tensor) -> None:
        """Group `i`'s copy, written by the kernel, in its master partition's place for DeepSpeed's copy statement."""
        partition = optimizer.single_partition_of_fp32_groups[i]
        if not optimizer.cpu_offload:
            partition.grad = None  # what DeepSpeed's step does to the entry right after the optimizer, done here
        self.handed[i] = partition
        optimizer.single_partition_of_fp32_groups[i] = copy

    def restore(self, optimizer) -> None:
        """Every master partition handed out back in its place."""
        for i, partition in self.handed.items():
            optimizer.single_partition_of_fp32_groups[i] = partition
        self.handed.clear()

    def forget_whole(self) -> None:
        """After a load: DeepSpeed copies each group whole once again."""
        self.whole.clear()
