"""What the bnb ZeRO optimizers of every stage share: refusals, each partition's step and its routes' log, the load
entry points, accounting of the state.

Stage 1/2 (stage_1_and_2.py) steps one flat partition per param group, stage 3 (stage3.py) one per sub-group; both
describe each partition as (its model parameters, the bnb param group, their precisions) through `_bnb_partitions`,
and the methods here work on that description only. Which code steps a parameter is optim/fused/route.py's decision.
"""

import contextlib
import functools
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.model_parallel import ModelParallelPlace
from deepspeed_bnb.checkpoint.format.records import GroupRecord, load_records, saved_master_mode
from deepspeed_bnb.optim import master_weights
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter, check_steppable
from deepspeed_bnb.optim.fused import route as fused_route
from deepspeed_bnb.optim.fused.partition_step import PartitionStep
from deepspeed_bnb.optim.fused.route import Route, describe_routes
from deepspeed_bnb.optim.master_weights import MasterWeights, resolve
from deepspeed_bnb.runtime.zero.compat import BF16_MASTER_VALIDATORS, autocast_gradscaler, by_name, \
    require_bf16_master
from deepspeed_bnb.runtime.zero.config import BnbSettings
from deepspeed_bnb.state_layout import Segment


DS_BF16_MASTER = "bf16_master_weights_and_gradients"  # DeepSpeed's ZeRO keyword for bf16 master weights
DS_BF16_STATES = "bf16_optimizer_states"  # DeepSpeed's ZeRO keyword for bf16 Adam moments


class BnbPartitionsMixin:
    """Shared by BnbZeroOptimizer (ZeRO-1/2) and BnbZeroStage3Optimizer. Both build themselves the same way:
    `_bnb_before_deepspeed` (arguments, refusals, bnb's view of the client optimizer), DeepSpeed's own __init__,
    `_bnb_after_deepspeed` (refusals, master-weight error terms, the kernel route), then `_bnb_add_partition` for each
    partition this rank steps; the class using it implements `_bnb_partitions` and the partition accessors below."""

    def _bnb_before_deepspeed(self, deepspeed_class: type, args: tuple, kwargs: dict, settings: BnbSettings,
                              model_parallel: ModelParallelPlace) -> dict:
        """The keyword arguments for DeepSpeed's `deepspeed_class.__init__`, every one by this release's name for it
        (compat.by_name), once what no stage supports is refused and bnb has seen the client optimizer: precision and
        config overrides per model parameter, and the master weights, while its param groups still hold the model
        parameters (DeepSpeed replaces them with flat partitions)."""
        kwargs = by_name(deepspeed_class.__init__, args, kwargs)
        optimizer = kwargs["init_optimizer"]
        check_steppable(optimizer)
        self.bnb_settings = settings  # the deepspeed_bnb keys of the engine's config (runtime/zero/config.py)
        self.bnb_model_parallel = model_parallel  # this rank's model-parallel place, recorded with the state
        # the engine's names of the model parameters (ZeRO-3 takes them from DeepSpeed 0.18.0 on; else None)
        self.bnb = BnbAdapter(optimizer, settings.keep_whole, settings.keep_whole_threshold, kwargs.get("param_names"))
        self._bnb_resolve_master(settings.master_weights, optimizer, kwargs, deepspeed_class)  # self.bnb_master
        return kwargs

    def _bnb_after_deepspeed(self, master_partitions: Sequence[torch.Tensor]) -> None:
        """Once DeepSpeed's __init__ has built the fp32 master partitions: what no stage supports then, their error
        terms, the optimizer-wide kernel route, and the empty per-partition tables `_bnb_add_partition` fills."""
        self._bnb_refuse_built()
        self._bnb_allocate_master_errors(master_partitions)  # self.bnb_master_errors
        self.bnb_layouts = []  # per partition: where its parameters lie on every rank (state_layout.py)
        self.bnb_eight_bit: List[List[bool]] = []  # per partition, per parameter in flat order: 8-bit state?
        self.bnb_segments: List[List[Segment]] = []  # per partition: this rank's segment table
        self.bnb_steps: List[PartitionStep] = []  # per partition: this rank's step (fused kernel and/or bnb's update)
        # why no parameter may be fused here (None: the contract decides per parameter)
        self.bnb_kernel: Route = fused_route.kernel_route(self.bnb_settings.fused_kernel, self.optimizer,
                                                          self._bnb_device(), self.bnb_master.mode)
        # what the kernel computes there (ops/rules.py: on a CPU, whether it steps 32-bit state as bnb would)
        self.bnb_arithmetic: str = fused_route.kernel_arithmetic(self.bnb_kernel, self.optimizer, self._bnb_device(),
                                                                 self.bnb_master.mode)

    def _bnb_add_partition(self, i: int, params, gindex: int, layout, rank: int,
                           state_eight_bit: Optional[Sequence[bool]] = None) -> None:
        """Partition i (its model parameters in flat order, in bnb param group `gindex`, laid out by `layout`):
        this rank's segments, bnb state (for the precisions `state_eight_bit`: by default the partition's own) and
        step, routed before the first step (for the log and for inspection)."""
        eight_bit = [self.bnb.eight_bit(p) for p in params]
        segments = layout.segments(rank, eight_bit)
        self._bnb_check_trust_ratio(i, layout, eight_bit)
        self.bnb_layouts.append(layout)
        self.bnb_eight_bit.append(eight_bit)
        self.bnb_segments.append(segments)
        partition = self.bnb_partition_tensor(i)
        group = self.optimizer.param_groups[gindex]
        with self._bnb_placing(i, layout, segments):
            self.optimizer.state[partition] = self.bnb.allocate(
                group, gindex, segments, layout.partition_size,
                eight_bit if state_eight_bit is None else state_eight_bit, partition.device)
            step = self._bnb_step_of(i, params, gindex, eight_bit, segments, partition.device)
            step.route(group)
        self.bnb_steps.append(step)

    def _bnb_placing(self, i: int, layout, segments):
        """Around the allocation of partition i's state (a context manager): what the stage needs then."""
        return contextlib.nullcontext()

    def _bnb_check_trust_ratio(self, i: int, layout, eight_bit) -> None:
        """Refuse a per-tensor trust ratio (bnb's fp32 LAMB/LARS) on a parameter this stage splits across ranks."""
        raise NotImplementedError

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
        """The flat fp32 tensor of partition i (the key of its state in `self.optimizer.state`), also mid-step."""
        raise NotImplementedError

    def bnb_master_partitions(self) -> List[torch.Tensor]:
        """Every partition's master weights, also mid-step (tools that count tensors during a step read this, not
        DeepSpeed's lists: at stages 1/2 an entry may be lent to the model's copy, runtime/zero/lp_copy.py)."""
        return [self.bnb_partition_tensor(i) for i in range(len(self.bnb_steps))]

    def bnb_partition_process_group(self, i: int):
        """The process group partition i is split over."""
        raise NotImplementedError

    def _bnb_resolve_master(self, setting: str, optimizer, kwargs: dict, deepspeed_class: type) -> None:
        """`self.bnb_master` from bnb_master_weights and DeepSpeed's bf16_master_weights_and_grads (in `kwargs`, the
        keyword arguments of `deepspeed_class`, DeepSpeed's ZeRO optimizer: set to what was resolved, for its
        __init__ to build)."""
        dtypes = {p.dtype for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        asked = bool(kwargs.get(DS_BF16_MASTER, False))
        self.bnb_master: MasterWeights = resolve(setting, asked, dtypes)
        if self.bnb_master.dtype == torch.bfloat16:
            require_bf16_master(deepspeed_class, self.bnb_master.mode)
            kwargs[DS_BF16_MASTER] = True
        elif asked:  # fp32 trainable weights under DeepSpeed's key: their master weights stay fp32 (resolve says why)
            kwargs[DS_BF16_MASTER] = False
            if dist.get_rank() == 0:
                logger.info(f"deepspeed_bnb: {master_weights.DS_KEY} is true, but the trainable weights are fp32: "
                            f"their master weights stay fp32 (bf16 ones would round them at every step).")

    def _bnb_allocate_master_errors(self, partitions: Sequence[torch.Tensor]) -> None:
        """`self.bnb_master_errors`: per partition, the int8 error term of compensated master weights (zero: DeepSpeed
        builds the bf16 master partition from the bf16 model weights, exactly), or None."""
        self.bnb_master_errors: List[Optional[torch.Tensor]] = [
            torch.zeros(p.numel(), dtype=torch.int8, device=p.device) if self.bnb_master.compensated else None
            for p in partitions]

    def _restore_from_bit16_weights(self):
        # DeepSpeed copies the model's bf16 weights into the master partitions (refresh_fp32_params, a load without
        # fp32 weights): the compensated master weights are those weights exactly, with no error left
        super()._restore_from_bit16_weights()
        for error in getattr(self, "bnb_master_errors", ()):  # (not yet allocated while DeepSpeed's __init__ runs)
            if error is not None:
                error.zero_()

    def _bnb_warn_master_change(self, source) -> None:
        """Say what a load into other master weights than the checkpoint's rounds (load_records converts them)."""
        saved = saved_master_mode(source.state(0)[C.BASE_OPTIMIZER_STATE_KEY])
        live = self.bnb_master.mode
        exact = saved == live or saved == master_weights.BF16 or live == master_weights.FP32
        if not exact and dist.get_rank(group=self.dp_process_group) == 0:
            logger.warning(f"deepspeed_bnb: the checkpoint holds {saved} master weights and this engine keeps {live} "
                           f"(zero_optimization.bnb_master_weights): they were rounded to {live} on load "
                           f"({master_weights.LOSS[live]}). Load into {saved} master weights to keep them exactly.")

    def _configure_master_weights(self, **settings):
        # DeepSpeed lets bf16 master weights through only with DeepSpeedCPUAdam on CPU offload, or with bf16 Adam
        # moments (bf16_optimizer_states), because fp32 moments would cost more than bf16 master weights save. bnb's
        # state is 8-bit and its update steps bf16 weights: the validator's reason does not hold (master_weights.py).
        if settings.pop(DS_BF16_STATES, False):
            logger.warning(f"deepspeed_bnb: bf16.bf16_optimizer_states is ignored for {type(self.optimizer).__name__}:"
                           f" its state is 8-bit (fp32 only for parameters below its min_8bit_size), smaller than "
                           f"bf16 moments. Remove the key to silence this.")
        if self.bnb_master.dtype == torch.bfloat16:
            settings.update({key: None for key in BF16_MASTER_VALIDATORS if key in settings})
        return super()._configure_master_weights(**settings)

    def _bnb_refuse_built(self) -> None:
        """What no stage supports, once DeepSpeed's optimizer is built."""
        if autocast_gradscaler(self) is not None:
            raise NotImplementedError("deepspeed_bnb: torch autocast with fp16 GradScaler is not supported; use "
                                      "DeepSpeed's own fp16/bf16 config sections.")

    def _bnb_step_of(self, i: int, params, gindex: int, eight_bit, segments, device) -> PartitionStep:
        """The step of partition i on this rank: its model parameters in flat order with their precisions, this rank's
        segments of them; routed by optim/fused/route.py under the optimizer-wide `self.bnb_kernel`."""
        return PartitionStep(self.bnb, gindex, segments, [self.bnb.override(p) for p in params], eight_bit, device,
                             self.bnb_kernel, on_reroute=functools.partial(self._bnb_log_reroute, i),
                             arithmetic=self.bnb_arithmetic)

    def _bnb_param_name(self, param, where: str) -> str:
        return self.param_names.get(param, where)

    def _bnb_model_routes(self) -> Dict[str, Route]:
        """Every model parameter's route, as the partitions' steps decided it (rank-independent: it depends on the
        parameter and its config only)."""
        out = {}
        for i, (params, _, _) in enumerate(self._bnb_partitions()):
            out.update({self._bnb_param_name(p, f"partition {i} #{j}"): r
                        for j, (p, r) in enumerate(zip(params, self.bnb_steps[i].param_routes))})
        return out

    def _bnb_log_routes(self) -> None:
        self.bnb_routes = self._bnb_model_routes()  # parameter name -> its Route
        if dist.get_rank(group=self.dp_process_group) == 0:
            logger.info(describe_routes(type(self.optimizer).__name__, self.bnb_routes))

    def _bnb_log_reroute(self, partition_no, old, new) -> None:
        params = self._bnb_partitions()[partition_no][0]
        changed = {self._bnb_param_name(p, f"partition {partition_no} #{j}"): r
                   for j, (p, was, r) in enumerate(zip(params, old, new)) if was != r}
        self.bnb_routes.update(changed)
        logger.info(f"rank {dist.get_rank(group=self.dp_process_group)}: the config changed; "
                    + describe_routes(type(self.optimizer).__name__, changed))

    def bnb_update_summary(self) -> str:
        """In words, which code steps the parameters (for logs and benchmark tables)."""
        fused = sum(route.fused for route in self.bnb_routes.values())
        if not fused:
            return "bnb's own update"
        where = self._bnb_device().type
        kernel = f"fused kernel ({'C++' if where == 'cpu' else where.upper()})"
        if fused == len(self.bnb_routes):
            return kernel
        return f"{kernel} for {fused} of {len(self.bnb_routes)} parameters, bnb's own update for the rest"

    def bnb_partition_numel(self) -> int:
        """Model-parameter elements this rank updates (its segments; alignment padding excluded)."""
        return sum(seg.numel for segments in self.bnb_segments for seg in segments)

    def load_state_dict(self, *args, **kwargs):
        # DeepSpeed calls this from its _load_zero_checkpoint only, which deepspeed_bnb replaces for these classes
        # (runtime/checkpointing.py) by bnb_load_checkpoint over the files each new rank needs. Anything else handing
        # over DeepSpeed's in-memory list (every rank's whole file, element-wise) is refused rather than half
        # supported.
        raise NotImplementedError(f"deepspeed_bnb: {type(self).__name__} loads its checkpoints through "
                                  f"engine.load_checkpoint(dir) (any data-parallel size); DeepSpeed's list of per-rank "
                                  f"ZeRO states is not an entry point. Call engine.load_checkpoint instead.")

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
        keys = [(g, key) for g, record in enumerate(records) for key in sorted(record.key_classes.whole(record.state))]
        if not keys:
            return
        mine = torch.tensor([zlib.crc32(records[g].state[key].detach().cpu().contiguous().view(torch.uint8)
                                        .numpy().tobytes()) for g, key in keys], dtype=torch.int64,
                            device=get_accelerator().current_device_name())  # NCCL reduces device tensors only
        lowest, highest = mine.clone(), mine.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN, group=self.dp_process_group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        differing = [f"{key!r} (param group {g})" for (g, key), lo, hi in zip(keys, lowest.tolist(), highest.tolist())
                     if lo != hi]
        if differing:
            raise RuntimeError(f"deepspeed_bnb: whole (replicated) optimizer state {', '.join(differing)} differs "
                               f"between ranks, so it cannot be saved once for all of them. If it is per-rank state, "
                               f"remove it from zero_optimization.bnb_keep_whole (or lower bnb_keep_whole_threshold).")
