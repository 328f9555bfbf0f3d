"""ZeRO-3 with `offload_optimizer: {"device": "nvme"}` and a bitsandbytes optimizer: which sub-groups live on NVMe,
and bringing one into memory whole (fp32 partition through DeepSpeed's swapper, bnb state through ours).

DeepSpeed swaps a sub-group when its fp32 partition has at least `min_aio_bytes` (1 MiB); the rest stay in host
memory as with CPU offload. Its step brings a swapped sub-group's fp32 partition and gradients in before
`_optimizer_step` and writes them back after; the bnb state follows the same rhythm inside `_optimizer_step`
(runtime/swap_tensor/bnb_state_swapper.py). Everything else that reads or writes a sub-group outside a step (the
checkpoint's records, a load, the parameter-level state API, zeroing the padding at initialize) does so inside
`_bnb_resident(i)`, one sub-group at a time: DeepSpeed's swap buffers hold a few sub-groups, not all of them.
"""

import contextlib
import os

from deepspeed import comm as dist

from deepspeed_bnb.optim.state_classes import StateClass
from deepspeed_bnb.runtime.swap_tensor.bnb_state_swapper import BnbStateSwapper

SWAP_SUBFOLDER = os.path.join("zero_stage_3", "bnb_state")  # under nvme_path, beside DeepSpeed's "optimizer"
SWAPPED = (StateClass.ELEMENT, StateClass.BLOCK)  # state classes written to NVMe (whole tensors and scalars stay)


class BnbNVMeStateMixin:
    """For BnbZeroStage3Optimizer: DeepSpeed's optimizer swapper keeps the fp32 partitions and gradients, the bnb state
    goes to BnbStateSwapper."""

    bnb_swapper = None  # BnbStateSwapper when the optimizer state is on NVMe

    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        # DeepSpeed's swapper takes every state tensor of >= 1 MiB as an fp32 moment of the partition's size: it
        # sees none of bnb's (an instance attribute: only this optimizer's swapper is narrowed)
        self.optimizer_swapper._get_state_tensors = lambda parameter: []
        folder = os.path.join(offload_optimizer_config.nvme_path, SWAP_SUBFOLDER, f"rank{dist.get_rank()}")
        self.bnb_swapper = BnbStateSwapper(folder, aio_config)

    def _bnb_on_nvme(self, i: int) -> bool:
        return self.bnb_swapper is not None and self._swappable_optimizer_subgroup(i)

    def _bnb_swapped_state(self, i: int) -> dict:
        """The tensors of sub-group i's bnb state that live on NVMe, by key."""
        state = self.optimizer.state.get(self.fp32_partitioned_groups_flat[i], {})
        classes = self.bnb.stored_classes(state) if state else {}
        return {key: value for key, value in state.items() if classes.get(key) in SWAPPED}

    @contextlib.contextmanager
    def _bnb_state_resident(self, i: int):
        """Sub-group i's bnb state in memory for the block (written back after it, also the first time)."""
        if not self._bnb_on_nvme(i):
            yield
            return
        tensors = self._bnb_swapped_state(i)
        if self.bnb_swapper.swapped(i):
            self.bnb_swapper.swap_in(i, tensors)
        yield
        self.bnb_swapper.swap_out(i, self._bnb_swapped_state(i))

    @contextlib.contextmanager
    def _bnb_resident(self, i: int):
        """Sub-group i whole in memory for the block: fp32 partition (DeepSpeed's swapper) and bnb state."""
        if not self._bnb_on_nvme(i):
            yield
            return
        self._optimizer_states_and_gradient_swap_in(i)
        try:
            with self._bnb_state_resident(i):
                yield
        finally:
            self._optimizer_states_and_gradient_swap_out(i)
