"""What the bnb ZeRO optimizers of every stage share: which code steps each parameter, and accounting of the state.

Stage 1/2 (stage_1_and_2.py) steps one flat partition per param group, stage 3 (stage3.py) one per sub-group; both
describe each partition as (its model parameters, the bnb param group, their precisions) through `_bnb_partitions`,
and the methods here work on that description only.
"""

import warnings
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from deepspeed_bnb.checkpoint.format.records import GroupRecord, load_records
from deepspeed_bnb.ops import loader, self_check
from deepspeed_bnb.optim.fused_contract import KERNEL_DEVICES, describe_routes, optimizer_reason
from deepspeed_bnb.optim.partition_step import FUSED, routes
from deepspeed_bnb.optim.state_classes import StateClass


class BnbPartitionsMixin:
    """Shared by BnbZeroOptimizer (ZeRO-1/2) and BnbZeroStage3Optimizer. The class using it sets `self.bnb`
    (BnbAdapter), `self.bnb_eight_bit` and `self.bnb_routes`, and implements `_bnb_partitions`."""

    def bnb_check_checkpoint(self, source, load_optimizer_states=True, load_from_fp32_weights=True) -> None:
        """Raise CheckpointMismatchError unless `bnb_load_checkpoint(source, ...)` would load; changes nothing.
        The engine runs this before DeepSpeed loads the module weights, which it would otherwise replace before the
        optimizer state is found not to fit."""
        load_records(source, self._bnb_group_records(), dist.get_rank(group=self.dp_process_group),
                     self._bnb_optimizer_class(), load_optimizer_states, load_from_fp32_weights, validate_only=True)

    def _bnb_partitions(self) -> List[Tuple[Sequence[torch.nn.Parameter], int, Sequence[bool]]]:
        """Per partition this rank steps: (its model parameters in flat order, bnb param-group index, 8-bit?)."""
        raise NotImplementedError

    def _bnb_device(self) -> torch.device:
        raise NotImplementedError

    def bnb_partition_tensor(self, i: int) -> torch.Tensor:
        """The flat fp32 tensor of partition i (the key of its state in `self.optimizer.state`)."""
        raise NotImplementedError

    def bnb_partition_process_group(self, i: int):
        """The process group partition i is split over."""
        raise NotImplementedError

    def _bnb_kernel_reason(self, setting, device) -> Optional[str]:
        """Why bnb's own update steps every parameter of this optimizer on `device` (None: the fused kernel steps
        each parameter whose bnb config it models; fused_contract.py). `true` turns every reason but the contract's
        into an error; a kernel that should run here and cannot warns once."""
        if setting is False:
            return "zero_optimization.bnb_fused_kernel is false"
        reason = optimizer_reason(self.optimizer)
        if reason is None and device.type not in KERNEL_DEVICES:
            reason = f"the fused kernels run on {' and '.join(KERNEL_DEVICES)}, not on {device.type}"
        if reason is None and device.type == "cuda" and setting == "auto":
            # the CUDA kernels are compiled and checked at first use, but have not yet been run and benchmarked
            # on a GPU by this project: an unproven path is never the silent default
            return ("the fused CUDA kernels are opt-in until validated on GPUs (zero_optimization.bnb_fused_kernel: "
                    "true uses them, after the first-use check)")
        if reason is None and not loader.load():
            reason = f"the compiled kernels could not be built or loaded here ({loader.error()})"
            self._bnb_fall_back(setting, reason)
        if reason is None:
            problem = self_check.disagreement(self.bnb.optimizer_name, device)
            if problem:
                reason = (f"the compiled '{self.bnb.optimizer_name}' kernel failed its first-use check on {device} "
                          f"against its pure-torch reference ({problem})")
                self._bnb_fall_back(setting, reason + "; please report it with your CPU/GPU model and torch/CUDA "
                                                      "versions")
        if reason is not None and setting is True:
            raise ValueError(f"zero_optimization.bnb_fused_kernel: true, but {reason}. Use \"auto\" (the kernel where "
                             f"it models bnb's update, bnb's own update elsewhere) or false.")
        return reason

    @staticmethod
    def _bnb_fall_back(setting, reason: str) -> None:
        if setting is not True:  # `true` raises instead (the caller)
            warnings.warn(f"deepspeed_bnb: {reason}. bitsandbytes' own update steps this run instead (same "
                          f"optimizer, bnb's speed); zero_optimization.bnb_fused_kernel: false silences this.",
                          RuntimeWarning, stacklevel=5)

    def _bnb_param_name(self, param, where: str) -> str:
        return self.param_names.get(param, where)

    def _bnb_model_routes(self) -> Dict[str, Optional[str]]:
        """Every model parameter's route (rank-independent: it depends on the parameter and its config only)."""
        out = {}
        for i, (params, gindex, eight_bit) in enumerate(self._bnb_partitions()):
            found = routes(self.bnb, self.bnb_kernel_reason, self.optimizer.param_groups[gindex], gindex,
                           [self.bnb.override(p) for p in params], eight_bit)
            out.update({self._bnb_param_name(p, f"partition {i} #{j}"): r
                        for j, (p, r) in enumerate(zip(params, found))})
        return out

    def _bnb_log_routes(self) -> None:
        self.bnb_routes = self._bnb_model_routes()  # parameter name -> FUSED or why bnb's update steps it
        if dist.get_rank(group=self.dp_process_group) == 0:
            logger.info(describe_routes(type(self.optimizer).__name__, self.bnb_routes))

    def _bnb_log_reroute(self, partition_no, segments, old, new) -> None:
        params = self._bnb_partitions()[partition_no][0]
        changed = {self._bnb_param_name(params[s.slot], f"partition {partition_no} #{s.slot}"): r
                   for s, was, r in zip(segments, old, new) if was != r}
        self.bnb_routes.update(changed)
        logger.info(f"rank {dist.get_rank(group=self.dp_process_group)}: the config changed; "
                    + describe_routes(type(self.optimizer).__name__, changed))

    def bnb_update_summary(self) -> str:
        """In words, which code steps the parameters (for logs and benchmark tables)."""
        fused = sum(route is FUSED for route in self.bnb_routes.values())
        if not fused:
            return "bnb's own update"
        where = self._bnb_device().type
        kernel = f"fused kernel ({'C++' if where == 'cpu' else where.upper()})"
        if fused == len(self.bnb_routes):
            return kernel
        return f"{kernel} for {fused} of {len(self.bnb_routes)} parameters, bnb's own update for the rest"

    def bnb_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds, measured from the tensors (shared maps counted once)."""
        seen = {}
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    seen[value.data_ptr()] = value.numel() * value.element_size()
        return sum(seen.values())

    def _bnb_optimizer_class(self) -> str:
        cls = type(self.optimizer)
        return f"{cls.__module__}.{cls.__qualname__}"

    def _bnb_check_whole_state(self, records: List[GroupRecord]) -> None:
        # Whole tensors are saved once (by rank 0) for all ranks: make sure they really are the same everywhere.
        keys = [(g, key) for g, record in enumerate(records) for key in sorted(record.state)
                if record.key_classes.get(key) == StateClass.WHOLE]
        if not keys:
            return
        mine = torch.tensor([zlib.crc32(records[g].state[key].detach().cpu().contiguous().view(torch.uint8)
                                        .numpy().tobytes()) for g, key in keys], dtype=torch.int64)
        lowest, highest = mine.clone(), mine.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.dp_process_group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        differing = [f"{key!r} (param group {g})" for (g, key), lo, hi in zip(keys, lowest, highest) if lo != hi]
        if differing:
            raise RuntimeError(f"deepspeed_bnb: whole (replicated) optimizer state {', '.join(differing)} differs "
                               f"between ranks, so it cannot be saved once for all of them. If it is per-rank state, "
                               f"remove it from zero_optimization.bnb_keep_whole (or lower bnb_keep_whole_threshold).")
