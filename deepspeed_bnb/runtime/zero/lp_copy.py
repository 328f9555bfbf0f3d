"""The model's copy of the updated weights, written by the fused kernel in place of DeepSpeed's pass after the step.

DeepSpeed's ZeRO steps (0.16-0.19) convert each updated fp32 master partition to the model's dtype in a pass of their
own, right after the optimizer. At stages 1/2 that is `bit16_partition_buffer.data.copy_(fp32_partition.data)` into the
pinned buffer sent to the device when the optimizer is offloaded (0.17 on), else
`bit16_partitions[rank].data.copy_(fp32_partition.data)` into the model's flat buffer. At stage 3 it is
`fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data)` in
`_reassign_or_swap_out_partitioned_parameters`. The pass reads the whole partition again and writes it (6 bytes per
element for a bf16 model, beside the 8-bit step's 16). Where both tensors live on the CPU (and, asked for, on one GPU),
the fused kernel writes that copy itself from the block it has just updated (the operators' `lp_params`), and
DeepSpeed's conversion is skipped:
- stage 3 overrides the method around it and skips just the copy for a sub-group the kernel wrote at this step
  (`LpCopies.take_written`);
- at stages 1/2 the statement sits inside DeepSpeed's `step()`. For it, the group's entry of
  `single_partition_of_fp32_groups` is the copy's own tensor (torch's `copy_` of a tensor onto the same data returns at
  once), handed back before `step()` returns (`LpCopies.restore`, from BnbZeroOptimizer.step's `finally`). Between the
  two, DeepSpeed's step reads that entry only in the copy statement (checked in the steps of 0.16.4, 0.17.1, 0.18.3 and
  0.19.8).

The bits are the same: the kernel rounds to nearest even as torch's conversion does (a NaN is stored as 0x7FC0, where
torch's vector loop writes 0xFFFF; the CUDA kernels convert with torch's own CUDA instruction), and torch copies the
segments bitsandbytes steps itself after its update.
On a GPU the CUDA kernels can write a bf16 copy the same way (DEEPSPEED_BNB_KERNEL_LP_COPY=gpu): an opt-in until a
GPU has measured it, so by default DeepSpeed converts there. Asked for, each GPU first checks the copy once against
torch's conversion of bitsandbytes' own update (ops/self_check.py), and DeepSpeed keeps converting, after a warning,
where it differs.
DeepSpeed converts as before:
- on a GPU unless asked otherwise (above), and there for an fp32 model; at stage 3 where the model's partition is on
  the GPU while the master is offloaded;
- with bf16 or compensated master weights (the first are the model's copy already, the second hold error terms);
- for an fp16 model;
- under DeepSpeed 0.16's offload at stages 1/2, which has no pinned buffer and sends the fp32 partition itself;
- for a partition the kernel steps no segment of;
- at a partition's first step after the engine is built or a checkpoint is loaded. DeepSpeed's whole copy then also
  writes the alignment padding, which the kernel never touches; it stays zero in the master weights after that.
DEEPSPEED_BNB_KERNEL_LP_COPY=0 leaves every copy to DeepSpeed (a setting for comparing the two).
"""

import os
import warnings
from dataclasses import dataclass, field
from typing import Dict, Optional, Set

import torch
from deepspeed import comm as dist

from deepspeed_bnb.ops import rules, self_check
from deepspeed_bnb.optim import master_weights

ENV = "DEEPSPEED_BNB_KERNEL_LP_COPY"
# the setting's values: 0 (DeepSpeed copies everywhere), 1 (the default: the kernels write the copy where it has been
# measured), gpu (the CUDA kernels too, behind their first-use check of the copy)
SETTINGS = ("0", "1", "gpu")
# whether a GPU run has shown the CUDA kernels' copy at least as fast as DeepSpeed's (the GPU proof's parts f and f3):
# until then 1 leaves the copy to DeepSpeed on GPUs, and only gpu asks the CUDA kernels for it
MEASURED_ON_GPU = False
# the model dtypes each device's kernels write (fp16: DeepSpeed copies; an fp32 model on a GPU too)
COPY_DTYPES = {"cpu": (torch.float32, torch.bfloat16), "cuda": (torch.bfloat16,)}


def setting() -> str:
    """DEEPSPEED_BNB_KERNEL_LP_COPY, checked (default 1)."""
    value = os.environ.get(ENV, "1")
    if value not in SETTINGS:
        raise ValueError(f"{ENV}={value!r}: use 1 (the fused CPU kernel writes the model's copy of the updated "
                         f"weights, the default), gpu (the CUDA kernels too: not yet measured on a GPU) or 0 "
                         f"(DeepSpeed converts the partition after the step)")
    return value


def enabled(device_type: str = "cpu") -> bool:
    """Whether the fused kernels of `device_type` ("cpu", "cuda") may write the model's copy."""
    value = setting()
    return value != "0" and (device_type == "cpu" or (device_type == "cuda" and (value == "gpu" or MEASURED_ON_GPU)))


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share no byte."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start + a.numel() * a.element_size() <= b_start or b_start + b.numel() * b.element_size() <= a_start


def _usable(copy: Optional[torch.Tensor], master: torch.Tensor, error: Optional[torch.Tensor]) -> bool:
    """Whether the kernel can write `copy` of fp32 `master` (both on one device, a dtype its kernels write, the same
    size, apart: under torch autocast DeepSpeed's ZeRO-3 makes the model's partition and the master one tensor, and
    there is no copy)."""
    return (copy is not None and master.dtype == torch.float32 and error is None and copy.device == master.device
            and copy.dtype in COPY_DTYPES.get(master.device.type, ()) and copy.numel() == master.numel()
            and copy.is_contiguous() and master.is_contiguous() and _apart(copy, master))


def _first_use_problem(optimizer, i: int, device: torch.device) -> Optional[str]:
    """On a GPU, why partition `i`'s kernel must not write the model's copy there: its rule's first-use check of the
    copy (ops/self_check.py, against torch's conversion of bitsandbytes' own update), run once per rule and device;
    None where it held, on the CPU (the suite holds the CPU kernels' copy to torch's), and for a rule without a kernel
    (its step writes no copy: PartitionStep.step)."""
    if device.type == "cpu":
        return None
    step = optimizer.bnb_steps[i]
    rule = step.adapter.optimizer_name
    if rule not in rules.RULES:
        return None
    problem = self_check.disagreement(rule, device, master_weights.FP32, step.arithmetic, lp_copy=True)
    return None if problem is None else f"the '{rule}' kernel's copy of the model's weights failed its first-use " \
                                        f"check on {device} ({problem})"


def zero12_copy(optimizer, i: int) -> Optional[torch.Tensor]:
    """The tensor DeepSpeed's ZeRO-1/2 step copies group `i`'s updated fp32 master partition into, where the kernel
    can write it instead; else None."""
    if optimizer.cpu_offload:
        buffers = getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None)  # DeepSpeed >= 0.17
        copy = buffers[i] if buffers else None
    else:
        copy = optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(group=optimizer.real_dp_process_group[i])]
    ok = _usable(copy, optimizer.single_partition_of_fp32_groups[i], optimizer.bnb_master_errors[i])
    return copy if ok else None


def zero3_copy(optimizer, i: int) -> Optional[torch.Tensor]:
    """The tensor DeepSpeed's ZeRO-3 step copies sub-group `i`'s updated fp32 master partition into, where the kernel
    can write it instead; else None (None also where the model's partition is swapped out to NVMe)."""
    copy = optimizer.fp16_partitioned_groups_flat[i]
    ok = _usable(copy, optimizer.fp32_partitioned_groups_flat[i], optimizer.bnb_master_errors[i])
    return copy if ok else None


@dataclass
class LpCopies:
    """One ZeRO optimizer's model copies written by the kernel: which partitions DeepSpeed has copied whole, and, during
    a step, the master partitions handed out (stages 1/2) or the sub-groups whose copy is written (stage 3)."""

    # partitions DeepSpeed has copied whole (padding included) since the engine was built or a checkpoint loaded
    whole: Set[int] = field(default_factory=set)
    # stages 1/2: group -> its fp32 master partition, while single_partition_of_fp32_groups holds the copy in its place
    handed: Dict[int, torch.Tensor] = field(default_factory=dict)
    # stage 3: sub-groups whose copy the kernel wrote at this step, not yet reached by DeepSpeed's conversion
    written: Set[int] = field(default_factory=set)
    # a GPU's first-use check of the copy failed: said once in a warning (DeepSpeed copies there from then on)
    refused: bool = False

    def target(self, optimizer, i: int, copy: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where `optimizer`'s kernel writes partition `i`'s copy at this step (`copy`, from zero12_copy or
        zero3_copy): asked for on its device (enabled), on a GPU once its first-use check has held, and after
        DeepSpeed's whole copy; None: DeepSpeed copies (see the module docstring)."""
        if copy is None or not enabled(copy.device.type):
            return None
        problem = _first_use_problem(optimizer, i, copy.device)
        if problem is not None:
            if not self.refused:
                self.refused = True
                warnings.warn(f"deepspeed_bnb: {ENV}={setting()}, but {problem}; DeepSpeed converts the partitions "
                              f"after the step instead (same results). Please report it with your GPU model and "
                              f"torch/CUDA versions.", RuntimeWarning, stacklevel=3)
            return None
        if i in self.whole:
            return copy
        self.whole.add(i)  # this step DeepSpeed copies the whole partition
        return None

    def hand_over(self, optimizer, i: int, copy: torch.Tensor) -> None:
        """Stages 1/2: group `i`'s copy, written by the kernel, in its master partition's place for DeepSpeed's copy
        statement."""
        partition = optimizer.single_partition_of_fp32_groups[i]
        if not optimizer.cpu_offload:
            partition.grad = None  # what DeepSpeed's step does to the entry right after the optimizer, done here
        self.handed[i] = partition
        optimizer.single_partition_of_fp32_groups[i] = copy

    def take_written(self, i: int) -> bool:
        """Stage 3: whether the kernel wrote sub-group `i`'s copy at this step (asked once, by the conversion)."""
        if i not in self.written:
            return False
        self.written.discard(i)
        return True

    def restore(self, optimizer) -> None:
        """After a step: every master partition handed out back in its place, no sub-group's copy pending."""
        for i, partition in self.handed.items():
            optimizer.single_partition_of_fp32_groups[i] = partition
        self.handed.clear()
        self.written.clear()

    def forget_whole(self) -> None:
        """After a load: DeepSpeed copies each partition whole once again."""
        self.whole.clear()
