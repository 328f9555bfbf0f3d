"""ZeRO-3 with `offload_optimizer: {"device": "nvme"}` and a bitsandbytes optimizer: which sub-groups live on NVMe,
and bringing one into memory whole (fp32 partition through DeepSpeed's swapper, bnb state through ours).

DeepSpeed swaps a sub-group when its fp32 partition has at least `min_aio_bytes` (1 MiB); the rest stay in host
memory as with CPU offload. Its step brings a swapped sub-group's fp32 partition and gradients in before
`_optimizer_step` and writes them back after; the bnb state follows the same rhythm inside `_optimizer_step`
(runtime/swap_tensor/bnb_state_swapper.py). Everything else that reads or writes a sub-group outside a step (the
checkpoint's records, a load, the parameter-level state API, zeroing the padding at initialize) does so inside
`_bnb_resident(i)`, one sub-group at a time: DeepSpeed's swap buffers hold a few sub-groups, not all of them.

bf16 master weights are DeepSpeed's to swap (its swapper works in the master dtype, the gradients with them);
compensated ones add an int8 error term per element, which DeepSpeed does not know: it goes to NVMe with the bnb state,
as one more file per sub-group (`MASTER_ERROR_FILE`), allocated at the sub-group's first swap-out.

A swap that fails (a file written short: a full disk; or found short before it is read) never raises where it
happens, on one rank alone, which would leave the others waiting in the next collective: it is recorded, a short
file of DeepSpeed's is extended with zeros so its reader does not abort the process, and at the end of the step (and
of initialize, a save, a load) every rank learns every rank's failures and raises the same NVMeSwapError. From then
on the engine refuses to save: its state is no longer whole, and the last checkpoint is what to resume from.
"""

import contextlib
import os
from typing import List, Optional

import torch

from deepspeed import comm as dist
from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

from deepspeed_bnb.runtime.swap_tensor.bnb_state_swapper import BnbStateSwapper, NVMeSwapError, file_size, release
from deepspeed_bnb.runtime.zero import compat

SWAP_SUBFOLDER = os.path.join("zero_stage_3", "bnb_state")  # under nvme_path, beside DeepSpeed's "optimizer"
SHOWN = 3  # swap failures named per rank in the error (the rest counted)
MASTER_ERROR_FILE = "master_error"  # the swap-file key of compensated master weights' error terms (beside bnb's keys)


class BnbNVMeStateMixin:
    """For BnbZeroStage3Optimizer: DeepSpeed's optimizer swapper keeps the fp32 partitions and gradients, the bnb state
    goes to BnbStateSwapper."""

    bnb_swapper = None  # BnbStateSwapper when the optimizer state is on NVMe
    bnb_swap_problems: List[str] = []  # this rank's swap failures since the ranks last agreed (its own list: set
    # with the swapper, the only writer)
    bnb_swap_failed: Optional[str] = None  # the agreed failure, the same on every rank: no save after it

    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        # DeepSpeed's swapper takes every state tensor of >= 1 MiB as an fp32 moment of the partition's size: it
        # sees none of bnb's (an instance attribute: only this optimizer's swapper is narrowed)
        self.optimizer_swapper._get_state_tensors = lambda parameter: []
        folder = os.path.join(offload_optimizer_config.nvme_path, SWAP_SUBFOLDER, f"rank{dist.get_rank()}")
        self.bnb_swapper = BnbStateSwapper(folder, aio_config)
        self.bnb_swap_problems = []
        self.bnb_nvme_path = offload_optimizer_config.nvme_path

    def _optimizer_states_and_gradient_swap_in(self, sub_group_id, timer_names=None):
        self._bnb_check_deepspeed_files(sub_group_id)
        # DeepSpeed's swap-out empties the partition with `torch.Tensor()` (OptimizerStateSwapInfo.release_memory),
        # which is fp32 whatever the master dtype, and its swap-in then asks its buffer pool, built for the master
        # dtype, for buffers of the placeholder's dtype: with bf16 master weights an AssertionError in
        # SwapBufferManager.allocate at the second swap-in (DeepSpeed 0.19.8). The placeholder gets its dtype back.
        partition = self.fp32_partitioned_groups_flat[sub_group_id]
        pooled = getattr(self.optimizer_swapper, "dtype", partition.dtype)  # (a release without it: fp32 only)
        if partition.numel() == 0 and partition.dtype != pooled:
            partition.data = torch.empty(0, dtype=pooled, device=partition.device)
        return super()._optimizer_states_and_gradient_swap_in(sub_group_id, timer_names)

    def _bnb_check_deepspeed_files(self, i: int) -> None:
        """DeepSpeed's swap file of sub-group i's fp32 partition is whole before it reads it. Its
        writes report success for short files (a full disk), and its reader asserts on one, aborting the process:
        a short file is recorded and extended with zeros (the run stops after this step on every rank)."""
        swapper = self.optimizer_swapper
        info = swapper.swap_params_info.get(OptimizerSwapper.parameter_id(self.fp32_partitioned_groups_flat[i]))
        if info is None:
            return
        # (the gradients' files are not checked: their size depends on the dtype DeepSpeed wrote them in)
        nbytes = swapper._io_aligned_numel(info.numel()) * swapper.swap_element_size
        for path in compat.optimizer_swap_paths(info):
            found = file_size(path)
            if found < nbytes:
                self.bnb_swap_problems.append(f"DeepSpeed's swap file {path} holds {found} bytes, {nbytes} expected")
                with open(path, "ab") as f:
                    f.truncate(nbytes)

    def _bnb_agree_swaps(self, during: str) -> None:
        """Every rank learns every rank's swap failures since the last call and raises the same error (a
        collective: every rank calls it at the same point)."""
        if self.bnb_swapper is None:
            return
        everyone = [None] * dist.get_world_size()
        compat.all_gather_object(everyone, list(self.bnb_swap_problems))
        self.bnb_swap_problems = []
        failed = [(rank, problems) for rank, problems in enumerate(everyone) if problems]
        if failed:
            self.bnb_swap_failed = (
                f"deepspeed_bnb: swapping optimizer state to NVMe failed during {during}: "
                + "; ".join(f"rank {rank}: {'; '.join(problems[:SHOWN])}"
                            + (f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else "")
                            for rank, problems in failed)
                + f". Free space under offload_optimizer.nvme_path ({self.bnb_nvme_path}) or point it at another "
                  f"disk, then resume from the last checkpoint: this engine's optimizer state is no longer whole.")
            raise NVMeSwapError(self.bnb_swap_failed)

    def _bnb_refuse_after_swap_failure(self) -> None:
        if self.bnb_swap_failed is not None:
            raise NVMeSwapError(f"{self.bnb_swap_failed} (refusing to save it)")

    def _bnb_on_nvme(self, i: int) -> bool:
        return self.bnb_swapper is not None and self._swappable_optimizer_subgroup(i)

    def _bnb_swapped_state(self, i: int) -> dict:
        """The tensors of sub-group i's bnb state that live on NVMe, by key: the partitioned ones (whole tensors and
        scalars stay in memory), and the error terms of compensated master weights (the master partition's companion,
        swapped with the state: DeepSpeed's swapper knows only the partition)."""
        state = self.optimizer.state.get(self.fp32_partitioned_groups_flat[i], {})
        swapped = self.bnb.stored_classes(state).partitioned(state) if state else {}
        error = self.bnb_master_errors[i]
        return swapped if error is None else {**swapped, MASTER_ERROR_FILE: error}

    def _bnb_first_error_terms(self, i: int) -> None:
        """Sub-group i's error terms before their first swap-out: zeros of the partition's size. Allocated one
        sub-group at a time, here, not with the others at initialize (a swapped partition is an empty placeholder
        then, and the whole rank's error terms at once would be the host memory NVMe offload exists to save)."""
        error = self.bnb_master_errors[i]
        if error is not None and error.numel() == 0:
            error.data = torch.zeros(self.fp16_partitioned_groups_flat_numel[i], dtype=error.dtype,
                                     device=error.device)

    @contextlib.contextmanager
    def _bnb_state_resident(self, i: int, read_only: bool = False):
        """Sub-group i's bnb state in memory for the block, written back after it (also the first time); read_only:
        released without a write (its files already hold it)."""
        if not self._bnb_on_nvme(i):
            yield
            return
        swapped = self.bnb_swapper.swapped(i)
        if not swapped:
            self._bnb_first_error_terms(i)
        tensors = self._bnb_swapped_state(i)
        if swapped:
            try:
                self.bnb_swapper.swap_in(i, tensors)  # a short file gives zeros: recorded, agreed on after the step
            except NVMeSwapError as exc:
                self.bnb_swap_problems.append(str(exc))
        yield
        if read_only and swapped:
            for tensor in tensors.values():
                release(tensor)
            return
        try:
            self.bnb_swapper.swap_out(i, self._bnb_swapped_state(i))
        except NVMeSwapError as exc:
            self.bnb_swap_problems.append(str(exc))

    @contextlib.contextmanager
    def _bnb_resident(self, i: int, read_only: bool = False):
        """Sub-group i whole in memory for the block: fp32 partition (DeepSpeed's swapper, which always writes it
        back) and bnb state (read_only: not written back)."""
        if not self._bnb_on_nvme(i):
            yield
            return
        self._optimizer_states_and_gradient_swap_in(i)
        try:
            with self._bnb_state_resident(i, read_only):
                yield
        finally:
            self._optimizer_states_and_gradient_swap_out(i)
