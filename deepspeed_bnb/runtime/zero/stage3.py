"""BnbZeroStage3Optimizer: DeepSpeed's ZeRO stage-3 optimizer, made block-aware for bitsandbytes optimizer state.

Stock ZeRO-3 hands the client optimizer one flat fp32 tensor per sub-group (this rank's slices of several
parameters, each slice starting at rank * ceil(numel / dp)); bnb then quantizes blocks that straddle parameters and
picks 8-bit or fp32 state for the whole sub-group, so the numerics change with the number of ranks, and the
checkpoint loads at the saving DP size only. Thin overrides of DeepSpeed's
`deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3` (same module path here):
- before DeepSpeed partitions anything, the parameters the bnb optimizer steps are marked for block-aligned
  partitions (runtime/zero/partition_parameters.py; those `zero.Init` already partitioned are partitioned again), so
  every slice is whole 256-element blocks of its parameter (state_layout.ShardedLayout);
- `__avg_scatter_grads` / `__avg_scatter_contiguous_grads` (`reduce_scatter` true / false): the reduction cuts each
  gradient by ceil(numel / dp), read from `param.grad`; for the call, marked parameters show their gradients padded
  to their partitions, so each rank receives the gradient of its own slice;
- `_optimizer_step`: per sub-group, the same PartitionStep as stages 1/2 (fused kernel where it is bnb's own
  arithmetic, bnb's `update_step` elsewhere, segment by segment; 8-bit vs fp32 state per model parameter; padding
  never updated), with DeepSpeed's unscale/clip factor folded in through `unscale_and_clip_grads`, as at stages 1/2
  (runtime/zero/unscale_factor.py);
- `_reassign_or_swap_out_partitioned_parameters`: where the model's partition and the master are on the CPU (on a
  GPU where asked for), the fused kernel has written the model's copy of the updated weights, and DeepSpeed's
  conversion is skipped (runtime/zero/lp_copy.py);
- `_unflatten_partitioned_parameters`, which DeepSpeed's step calls for every sub-group to point the parameter
  partitions at their flat buffer again: skipped where they still view what its last call left
  (runtime/zero/param_views.py);
- `state_dict`: the versioned per-rank record of stages 1/2, one group per bnb param group (its sub-groups joined),
  plus DeepSpeed's `fp32_flat_groups` in stock ZeRO-3 slices, so that DeepSpeed's zero_to_fp32 still reads the
  weights; it loads at any DP size, and from or into stage 1/2, through `bnb_load_checkpoint`.
Everything else (parameter gathering, prefetch, persistence, gradient reduction, clipping, loss scaling, offload) is
DeepSpeed's. Configurations whose code paths bypass these overrides are refused at initialize (`_refuse_unsupported`).
"""

import contextlib
import inspect
from typing import Dict, List

import torch
import torch.nn.functional as F
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.manifest import describe
from deepspeed_bnb.checkpoint.format.model_parallel import ALONE, ModelParallelPlace
from deepspeed_bnb.checkpoint.format.records import GroupRecord, build_record, load_records
from deepspeed_bnb.ops import compensated
from deepspeed_bnb.runtime.zero import compat
from deepspeed_bnb.runtime.zero.bnb_partitions import BnbPartitionsMixin
from deepspeed_bnb.runtime.zero.lp_copy import LpCopies, zero3_copy
from deepspeed_bnb.runtime.zero.nvme_state import BnbNVMeStateMixin
from deepspeed_bnb.runtime.zero.param_views import repoint
from deepspeed_bnb.runtime.zero.unscale_factor import StepFactor, as_step_scale
from deepspeed_bnb.runtime.zero.config import BnbSettings
from deepspeed_bnb.runtime.zero.partition_parameters import block_align, is_block_aligned
from deepspeed_bnb.state_layout import ShardedLayout
from deepspeed_bnb.utils.tensor_fragment import PARAM_STATE_ATTR, ParamOptimizerState

STAGE = 3


def _refuse_unsupported(optimizer, kwargs: dict) -> None:
    """Stage-3 features that cannot step bnb state block-aligned: refused before anything is built, with the DeepSpeed
    constraint and what to use instead (docs/zero_features.md has the evidence)."""
    checks = [
        (kwargs.get("zero_quantized_weights") or kwargs.get("zero_quantized_nontrainable_weights"),
         "zero_optimization.zero_quantized_weights", "DeepSpeed's quantized all-gather of a parameter sizes its int8 "
         "buffer as ceil(numel / dp) * dp and dequantizes it in dp equal groups, which the block-aligned partitions "
         "of bnb's parameters (larger) do not fit", "set it to false (bf16 weights halve the all-gather instead)"),
        (kwargs.get("all2all_process_group") is not None, "zero_optimization.zero_quantized_gradients",
         "its all-to-all gradient reduction cuts each gradient itself, not at the block-aligned partitions",
         "set it to false (the default reduce-scatter)"),
        (kwargs.get("offload_ratio", 0.0) not in (0.0, 1.0), "offload_optimizer.ratio",
         "DeepSpeed's partial offload (Twin-Flow) asserts \"Hybrid Optimizer Only Supports DeepSpeedCPUAdam\" for any "
         "client optimizer", "remove it (full offload, ratio 1, keeps the 8-bit state)"),
        (kwargs.get("zenflow_config") is not None, "zero_optimization.zenflow", "ZenFlow steps with the "
         "ZenFlowCPUAdam DeepSpeed builds from the config's optimizer section and takes no client optimizer",
         "remove the zenflow section"),
    ]
    for refused, setting, why, fix in checks:
        if refused:
            raise NotImplementedError(
                f"deepspeed_bnb: {setting} is not supported with the bitsandbytes optimizer "
                f"{type(optimizer).__name__} under ZeRO stage 3: {why}. Fix: {fix}.")


class BnbZeroStage3Optimizer(BnbNVMeStateMixin, BnbPartitionsMixin, DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 whose client optimizer is a bitsandbytes optimizer (8-bit or 32-bit state)."""

    def __init__(self, *args, bnb_settings: BnbSettings = BnbSettings(),
                 bnb_model_parallel: ModelParallelPlace = ALONE, **kwargs):
        kwargs = self._bnb_before_deepspeed(DeepSpeedZeroOptimizer_Stage3, args, kwargs, bnb_settings,
                                            bnb_model_parallel)
        module, init_optimizer = kwargs["module"], kwargs["init_optimizer"]
        _refuse_unsupported(init_optimizer, kwargs)
        # Before DeepSpeed partitions this rank's slices: every slice whole blocks of its parameter.
        block_align([p for group in init_optimizer.param_groups for p in group["params"] if p.requires_grad])
        super().__init__(**kwargs)
        compat.name_stage3_params(self, module)  # DeepSpeed < 0.18.0 keeps no parameter names
        self._bnb_after_deepspeed(self.fp32_partitioned_groups_flat)
        self._bnb_inv_scale = {}  # sub-group -> 1 / DeepSpeed's combined unscale/clip factor, folded into the step
        self._bnb_unscale = StepFactor(clips_invalid=False)  # the step's factor, as ZeRO-3's method computes it
        self.bnb_lp_copies = LpCopies()  # the model's copies the fused kernel writes in place of DeepSpeed's pass
        self.bnb_sub_groups: Dict[int, List[int]] = {}  # bnb param-group index -> its sub-groups, in order
        for i in range(len(self.fp16_groups)):
            self.bnb_sub_groups.setdefault(self.sub_group_to_group_id[i], []).append(i)
        # every sub-group of a param group holds the keys of every precision in that group, so the group's record is
        # the sub-groups' tensors joined: param-group index -> precisions of all its parameters
        group_eight_bit = {g: [self.bnb.eight_bit(p) for j in subs for p in self.fp16_groups[j]]
                           for g, subs in self.bnb_sub_groups.items()}
        for i, params in enumerate(self.fp16_groups):
            gindex = self.sub_group_to_group_id[i]
            self._bnb_add_partition(i, params, gindex, self._bnb_check_layout(i),
                                    dist.get_rank(group=compat.sub_group_process_group(self, i)),
                                    group_eight_bit[gindex])
        self._bnb_agree_swaps("initialize")  # with the optimizer on NVMe: every rank's writes so far were whole
        with self._bnb_holding():
            self._bnb_log_routes()
        for i, params in enumerate(self.fp16_groups):  # DeepSpeed's parameter-level state API, answered from bnb state
            for slot, param in enumerate(params):
                setattr(param, PARAM_STATE_ATTR, ParamOptimizerState(
                    self, i, slot, self._bnb_param_name(param, f"#{slot} of sub-group {i}"),
                    gindex=self.sub_group_to_group_id[i]))

    @contextlib.contextmanager
    def _bnb_placing(self, i, layout: ShardedLayout, segments):
        # on NVMe the sub-group's state is in memory while it is allocated, and written there after; DeepSpeed
        # leaves the padding of its slices unset; bnb's get_config looks the partition up in its param group
        with self._bnb_resident(i):
            self._bnb_zero_padding(i, layout, segments)
            with self._bnb_holding(i):
                yield

    @contextlib.contextmanager
    def _bnb_holding(self, sub_group_id=None):
        # DeepSpeed empties the client optimizer's param lists and puts one sub-group's flat partition in for each
        # step (`_optimizer_step`); bnb's get_config looks its parameter up there, so do the same around bnb calls
        # (None: every param group holds its first sub-group).
        held = {}
        for i in range(len(self.fp16_groups)) if sub_group_id is None else [sub_group_id]:
            held.setdefault(self.sub_group_to_group_id[i], [self.fp32_partitioned_groups_flat[i]])
        for gindex, params in held.items():
            self.optimizer.param_groups[gindex]["params"] = params
        try:
            yield
        finally:
            for gindex in held:
                self.optimizer.param_groups[gindex]["params"] = []

    def _bnb_partitions(self):
        return [(params, self.sub_group_to_group_id[i], self.bnb_eight_bit[i])
                for i, params in enumerate(self.fp16_groups)]

    def _bnb_device(self):
        return self.fp32_partitioned_groups_flat[0].device

    def bnb_partition_tensor(self, i):
        return self.fp32_partitioned_groups_flat[i]

    def bnb_partition_process_group(self, i):
        return compat.sub_group_process_group(self, i)

    # ---- layout -------------------------------------------------------------------------------------------------

    def _bnb_check_layout(self, i) -> ShardedLayout:
        params = self.fp16_groups[i]
        dp = dist.get_world_size(group=compat.sub_group_process_group(self, i))
        if dp != dist.get_world_size(group=self.dp_process_group):
            raise NotImplementedError("deepspeed_bnb: ZeRO-3 parameters partitioned over a process group other than "
                                      "data parallelism (MoE expert groups) are not supported with bitsandbytes "
                                      "optimizers.")
        layout = ShardedLayout(numels=tuple(p.ds_numel for p in params), dp=dp)
        if (not all(is_block_aligned(p) for p in params)
                or [p.partition_numel() for p in params] != [layout.slice_numel(j) for j in range(len(params))]
                or self.fp16_partitioned_groups_flat_numel[i] != layout.partition_size):
            raise RuntimeError(f"deepspeed_bnb: ZeRO-3 sub-group {i} was not partitioned block-aligned (slices "
                               f"{[p.partition_numel() for p in params][:8]}, expected "
                               f"{[layout.slice_numel(j) for j in range(min(8, len(params)))]}); this DeepSpeed "
                               f"version sizes partitions another way. Use a supported DeepSpeed version.")
        return layout

    def _bnb_check_trust_ratio(self, i, layout: ShardedLayout, eight_bit):
        # bnb's fp32 LAMB/LARS path scales each update by a per-tensor norm ratio; ZeRO-3 splits every parameter
        # across all ranks, so at DP > 1 no fp32-state parameter lies inside one partition.
        if layout.dp == 1:
            return
        for j, param in enumerate(self.fp16_groups[i]):
            if not eight_bit[j] and self.bnb.max_unorm(param) > 0:
                raise NotImplementedError(
                    f"deepspeed_bnb: parameter {self._bnb_param_name(param, f'#{j}')} has fp32 state, but "
                    f"{type(self.optimizer).__name__} applies a per-tensor trust ratio (max_unorm="
                    f"{self.bnb.max_unorm(param)}) to fp32 state, and ZeRO-3 splits it across {layout.dp} ranks. Use "
                    f"8-bit state for it (lower min_8bit_size), max_unorm=0, ZeRO stage 1/2, or one rank.")

    @torch.no_grad()
    def _bnb_zero_padding(self, i, layout: ShardedLayout, segments) -> None:
        # DeepSpeed allocates partitions with torch.empty and copies only the parameter's elements: the padding of
        # a slice is whatever memory held. Zero it once (fp32 master and low-precision copy); the step never writes it.
        real = {s.slot: s.numel for s in segments}
        for tensor in (self.fp32_partitioned_groups_flat[i], self.fp16_partitioned_groups_flat[i]):
            if tensor is None or tensor.numel() == 0:
                continue
            for j, offset in enumerate(layout.offsets):
                used = real.get(j, 0)
                tensor.narrow(0, offset + used, layout.slice_numel(j) - used).zero_()

    # ---- gradients ----------------------------------------------------------------------------------------------

    # Both reductions (reduce_scatter true and false) cut each gradient at rank * ceil(numel / dp), reading each
    # size from `param.grad`. A block-aligned parameter's slice starts at rank * aligned_size() / dp instead: show
    # DeepSpeed, for the call, each such gradient padded to aligned_size() (zeros after the gradient), and its cut
    # is then exactly each rank's slice; the reduction itself (dtype, averaging, predivide) stays DeepSpeed's.

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, *args, **kwargs):
        # reduce_scatter: true (reduce_scatter_coalesced on each gradient). Costs a padded copy of the gradients
        # whose size changes. (its other argument, communication_data_type, arrived in DeepSpeed 0.17.2: passed
        # through as given)
        stock_scatter = DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads
        sizes = _aligned_sizes(params_to_reduce)
        padded = [g if g.numel() == n else F.pad(g.reshape(-1), (0, n - g.numel()))
                  for g, n in zip((p.grad.data for p in params_to_reduce), sizes)]
        with _showing_grads(params_to_reduce, padded):
            return stock_scatter(self, params_to_reduce, *args, **kwargs)

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads(self, buffer_to_reduce, *args, **kwargs):
        # reduce_scatter: false: DeepSpeed all-reduces the bucket (its gradients back to back) and cuts it. Lay the
        # bucket out with the padded gradients instead: one padded copy of the bucket. (`communication_data_type`,
        # its other argument, arrived in DeepSpeed 0.17.2 with the per-dtype buckets)
        stock_reduce = DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads
        params = compat.ipg_bucket_params(self, *args, **kwargs)
        sizes = _aligned_sizes(params)
        if all(n == p.grad.numel() for p, n in zip(params, sizes)):
            return stock_reduce(self, buffer_to_reduce, *args, **kwargs)
        padded = buffer_to_reduce.new_zeros(sum(sizes))
        views, at, to = [], 0, 0
        for param, size in zip(params, sizes):
            numel = param.grad.numel()
            padded.narrow(0, to, numel).copy_(buffer_to_reduce.narrow(0, at, numel))
            views.append(padded.narrow(0, to, size))
            at, to = at + numel, to + size
        with _showing_grads(params, views):
            return stock_reduce(self, padded, *args, **kwargs)

    # ---- step ---------------------------------------------------------------------------------------------------

    def _unflatten_partitioned_parameters(self, sub_group_id):
        # DeepSpeed's step re-points every parameter partition of each sub-group at its flat buffer after the step:
        # run only where the last call's views moved since (param_views.py)
        repoint(self, sub_group_id, self.fp16_partitioned_groups_flat[sub_group_id],
                lambda: super(BnbZeroStage3Optimizer, self)._unflatten_partitioned_parameters(sub_group_id),
                lambda: self.fp16_partitioned_groups[sub_group_id])

    def unscale_and_clip_grads(self, sub_group_id, total_norm):
        # DeepSpeed's step multiplies the sub-group's gradient partition by 1 / (loss scale * clip) here, just before
        # _optimizer_step(sub_group_id), in a pass of its own: the partition's step folds that factor into the
        # kernel's pass instead, as at stages 1/2 (runtime/zero/unscale_factor.py). Its step has returned before
        # this for an invalid norm, and it multiplies by whatever the formula gives, 1.0 included.
        grad = self.fp32_partitioned_groups_flat[sub_group_id].grad
        self._bnb_inv_scale[sub_group_id] = as_step_scale(self._bnb_unscale(self, total_norm), grad.device)

    def _optimizer_step(self, sub_group_id):
        partition = self.fp32_partitioned_groups_flat[sub_group_id]
        group = self.optimizer.param_groups[self.sub_group_to_group_id[sub_group_id]]
        copy = self.bnb_lp_copies.target(self, sub_group_id, zero3_copy(self, sub_group_id))
        with self._bnb_holding(sub_group_id), self._bnb_state_resident(sub_group_id):
            written = self.bnb_steps[sub_group_id].step(group, partition, partition.grad,
                                                        self.optimizer.state[partition],
                                                        self._bnb_inv_scale.pop(sub_group_id, None),
                                                        self.bnb_master_errors[sub_group_id], lp_params=copy)
        if written:  # DeepSpeed's conversion, which comes next, is not needed (_reassign_or_swap_out_...)
            self.bnb_lp_copies.written.add(sub_group_id)

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id):
        # DeepSpeed copies the updated fp32 partition into the model's partition here, then re-points the parameters
        # at it; where the kernel has just written that copy (lp_copy.py), only the re-pointing is left
        if self.bnb_lp_copies.take_written(sub_group_id):
            self._unflatten_partitioned_parameters(sub_group_id)
            return
        super()._reassign_or_swap_out_partitioned_parameters(sub_group_id)

    # ---- DeepSpeed's parameter-level API ------------------------------------------------------------------------

    # DeepSpeed's ZeRO-3 safe_{get,set}_{full,local}_optimizer_state read `optimizer.state[flat][key]` element by
    # element: for bnb state that is uint8 codes or per-block scales, handed out as if they were moments. With a key,
    # the four entry points below answer from the parameter's ParamOptimizerState instead (utils/tensor_fragment.py:
    # dequantized fp32 moments by bnb's and torch's names, as at stages 1/2; local = this rank's elements of the
    # parameter, without the partition's padding). Without a key (fp32 weights, gradients) they stay DeepSpeed's.

    def _bnb_param_state(self, param) -> ParamOptimizerState:
        return getattr(param, PARAM_STATE_ATTR)

    def _bnb_with_state(self, param, optim_state_key, method, *args):
        """`method(*args)`; with a key, on a sub-group whose bnb state is on NVMe: with that state in memory, and what
        it returns copied out of it. DeepSpeed's own calls without a key swap the fp32 partition in themselves; the
        compensated master weights' calls (ours) bring the sub-group in whole."""
        if not param.requires_grad or self.bnb_swapper is None:
            return method(*args)
        i = self.grad_position[self.get_param_id(param)][0]
        if optim_state_key is not None:
            resident = self._bnb_state_resident(i)
        elif self.bnb_master.compensated:  # the weights from the master partition and its error terms, both swapped
            resident = self._bnb_resident(i)
        else:
            return method(*args)
        with resident:
            out = method(*args)
            return out.clone() if torch.is_tensor(out) else out

    # Without a key: the weights. bf16 master weights are widened to fp32 (DeepSpeed hands out the partition's dtype);
    # compensated ones are joined with their error terms on get and split into both on set.

    def _bnb_master_slice(self, param):
        """(this rank's slice of the parameter's master weights, of their error terms); DeepSpeed's placement."""
        group, offset, numel = self.grad_position[self.get_param_id(param)][:3]
        return (self.fp32_partitioned_groups_flat[group].narrow(0, offset, numel),
                self.bnb_master_errors[group].narrow(0, offset, numel))

    @torch.no_grad()
    def _bnb_local_master(self, param) -> torch.Tensor:
        master, error = self._bnb_master_slice(param)
        return compensated.join(master, error)

    @torch.no_grad()
    def _bnb_full_master(self, param) -> torch.Tensor:
        """The parameter's compensated master weights, fp32, from every rank's slice (DeepSpeed's
        _fp32_state_allgather gathers in the master dtype, bf16 here)."""
        group = compat.param_partition_group(self, param)
        local = self._bnb_local_master(param).to(param.device)
        full = torch.empty(local.numel() * dist.get_world_size(group=group), dtype=torch.float32, device=param.device)
        dist.allgather_fn(full, local, group=group)
        return full.narrow(0, 0, param.ds_numel).view(param.ds_shape)

    def get_full_hp_param(self, param, optim_state_key=None):
        return self._bnb_with_state(param, optim_state_key, self._bnb_get_full_hp_param, param, optim_state_key)

    def _bnb_get_full_hp_param(self, param, optim_state_key=None):
        if optim_state_key is None or not param.requires_grad:  # weights; frozen: DeepSpeed's None
            if self.bnb_master.compensated and param.requires_grad:
                return self._bnb_full_master(param)
            full = super().get_full_hp_param(param, optim_state_key)
            return full if full is None else full.float()
        return self._bnb_param_state(param).get_full(param, optim_state_key)

    def set_full_hp_param(self, value, param, optim_state_key=None):
        return self._bnb_with_state(param, optim_state_key, self._bnb_set_full_hp_param, value, param, optim_state_key)

    def _bnb_set_full_hp_param(self, value, param, optim_state_key=None):
        if optim_state_key is None or not param.requires_grad:  # weights; frozen: DeepSpeed's None
            if self.bnb_master.compensated and param.requires_grad:
                master, error = self._bnb_master_slice(param)
                start = master.numel() * compat.param_partition_rank(self, param)
                mine = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)  # padding stays 0
                real = max(0, min(master.numel(), param.ds_numel - start))  # block-aligned slices end in padding
                mine[:real] = value.flatten().narrow(0, start, real)
                compensated.split_(mine, master, error)
                return None
            return super().set_full_hp_param(value, param, optim_state_key)
        return self._bnb_param_state(param).set_full(param, optim_state_key, value)

    def get_local_fp32_param(self, param, optim_state_key=None):
        return self._bnb_with_state(param, optim_state_key, self._bnb_get_local_fp32_param, param, optim_state_key)

    def _bnb_get_local_fp32_param(self, param, optim_state_key=None):
        if optim_state_key is None or not param.requires_grad:  # weights; frozen: DeepSpeed's None
            if self.bnb_master.compensated and param.requires_grad:
                return self._bnb_local_master(param)
            local = super().get_local_fp32_param(param, optim_state_key)
            return local if local is None else local.float()
        return self._bnb_param_state(param).get_local(optim_state_key, device=param.ds_tensor.device)

    def set_local_hp_param(self, value, param, optim_state_key=None):
        return self._bnb_with_state(param, optim_state_key, self._bnb_set_local_hp_param, value, param, optim_state_key)

    def _bnb_set_local_hp_param(self, value, param, optim_state_key=None):
        if optim_state_key is None or not param.requires_grad:  # weights; frozen: DeepSpeed's None
            if self.bnb_master.compensated and param.requires_grad:
                master, error = self._bnb_master_slice(param)
                compensated.split_(value.flatten().float(), master, error)
                return None
            return super().set_local_hp_param(value, param, optim_state_key)
        return self._bnb_param_state(param).set_local(optim_state_key, value)

    def _restore_from_bit16_weights(self):
        # DeepSpeed copies the 16-bit partitions into the fp32 ones, which are empty placeholders while on NVMe
        if self.bnb_swapper is None:
            return super()._restore_from_bit16_weights()
        for i in range(len(self.fp16_groups)):  # on NVMe: one sub-group in memory at a time
            with self._bnb_resident(i):
                self.fp32_partitioned_groups_flat[i].data.copy_(self.fp16_partitioned_groups_flat[i].data)
                if self.bnb_master_errors[i] is not None:  # compensated: the 16-bit weights exactly, no error left
                    self.bnb_master_errors[i].zero_()
        return None

    def _get_fp32_opt_state_partition(self, param, *args, **kwargs):
        # (DeepSpeed 0.16.9 added `release_swap_buffers` before the key: bound against the installed signature)
        stock_get = DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition
        key = inspect.signature(stock_get).bind(self, param, *args, **kwargs).arguments.get("optim_state_key")
        if key is not None:  # the entry points above never get here with a key: any other caller would
            raise NotImplementedError(f"deepspeed_bnb: optimizer state {key!r} of a bitsandbytes "
                                      f"optimizer is not one fp32 value per element (8-bit codes, per-block "
                                      f"scales); use safe_get_full_optimizer_state / safe_get_local_optimizer_state.")
        return stock_get(self, param, *args, **kwargs)

    # ---- accounting ---------------------------------------------------------------------------------------------

    def _bnb_groups(self):
        """Per bnb param group with trainable parameters, in order: (index, parameters, layout, precisions)."""
        dp = dist.get_world_size(group=self.dp_process_group)
        for gindex, subs in self.bnb_sub_groups.items():
            params = [p for i in subs for p in self.fp16_groups[i]]
            yield gindex, params, ShardedLayout(tuple(p.ds_numel for p in params), dp), \
                [e for i in subs for e in self.bnb_eight_bit[i]]

    def bnb_description(self) -> dict:
        """What a checkpoint manifest records about the run that wrote it."""
        return describe(self._bnb_optimizer_class(), STAGE, dist.get_world_size(group=self.dp_process_group),
                        [([self.param_names[p] for p in params], layout.numels, eight_bit)
                         for _, params, layout, eight_bit in self._bnb_groups()], self.bnb_master.mode)

    # ---- checkpoint ---------------------------------------------------------------------------------------------

    def _bnb_group_records(self) -> List[GroupRecord]:
        """Per param group: its sub-groups' state and master weights joined (copies when there are several)."""
        records = []
        for gindex, params, layout, eight_bit in self._bnb_groups():
            subs = self.bnb_sub_groups[gindex]
            states, masters, errors = [], [], []
            for i in subs:  # on NVMe: brought in one at a time and copied (their memory goes with the swap-out)
                with self._bnb_resident(i, read_only=True):
                    state, master = self.optimizer.state[self.fp32_partitioned_groups_flat[i]], \
                        self.fp32_partitioned_groups_flat[i].data
                    error = self.bnb_master_errors[i]
                    if self._bnb_on_nvme(i):
                        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
                        master = master.clone()
                        error = error if error is None else error.clone()
                    states.append(state)
                    masters.append(master)
                    errors.append(error)
            classes = self.bnb.stored_classes(states[0])
            state = classes.join(states)
            master = _joined(masters)
            error = _joined(errors) if self.bnb_master.compensated else None
            records.append(GroupRecord(hyperparams=self.optimizer.param_groups[gindex], layout=layout,
                                       param_names=[self.param_names[p] for p in params], eight_bit=eight_bit,
                                       key_classes=classes, state=state, master=master, master_error=error,
                                       master_layout=ShardedLayout(layout.numels, layout.dp, block=1)))
        return records

    def _bnb_record_pieces(self, records: List[GroupRecord]):
        """Every sub-group's place in the group records (as `_bnb_group_records` joins them): (record, sub-group, offset
        of its 8-bit state and master weights, offset of its fp32 state)."""
        for record, (gindex, *_) in zip(records, self._bnb_groups()):
            offset = fp32_offset = 0
            for i in self.bnb_sub_groups[gindex]:
                yield record, i, offset, fp32_offset
                offset += self.bnb_layouts[i].partition_size
                fp32_offset += sum(s.numel for s in self.bnb_segments[i] if not s.eight_bit)

    def _bnb_split_records(self, records: List[GroupRecord]) -> None:
        """Write loaded group records back into the sub-groups (the inverse of `_bnb_group_records`)."""
        for record, i, offset, fp32_offset in self._bnb_record_pieces(records):
            with self._bnb_resident(i):
                self._bnb_split_record(record, i, offset, fp32_offset)

    def _bnb_split_record(self, record: GroupRecord, i: int, offset: int, fp32_offset: int) -> None:
        """Sub-group i's part of a loaded group record, from `offset` (8-bit and master) / `fp32_offset` (fp32 state)
        on, written into its state and master weights."""
        partition = self.fp32_partitioned_groups_flat[i]
        size = self.bnb_layouts[i].partition_size
        fp32_size = sum(s.numel for s in self.bnb_segments[i] if not s.eight_bit)
        record.key_classes.cut_into(self.optimizer.state[partition], record.state, offset, size, fp32_offset,
                                    fp32_size)
        if record.master.data_ptr() != partition.data_ptr():  # several sub-groups: a joined copy
            partition.data.copy_(record.master.narrow(0, offset, size))
            if record.master_error is not None:
                self.bnb_master_errors[i].copy_(record.master_error.narrow(0, offset, size))

    @torch.no_grad()
    def _bnb_stock_fp32_groups(self, records: List[GroupRecord]) -> List[torch.Tensor]:
        """This rank's master weights in stock ZeRO-3 slices (ceil(numel / dp) per parameter), per sub-group:
        DeepSpeed's zero_to_fp32 reads `fp32_flat_groups` that way. One all-gather per parameter. fp32, or bf16 for
        bf16 master weights (compensated ones are joined to the fp32 values they stand for)."""
        # each sub-group's master weights, from the records (on NVMe: the copies they hold, not a second swap-in)
        masters, errors = {}, {}
        for record, i, offset, _ in self._bnb_record_pieces(records):
            size = self.bnb_layouts[i].partition_size
            masters[i] = record.master.narrow(0, offset, size)
            errors[i] = None if record.master_error is None else record.master_error.narrow(0, offset, size)
        out = []
        for i, params in enumerate(self.fp16_groups):
            group = compat.sub_group_process_group(self, i)
            rank, dp = dist.get_rank(group=group), dist.get_world_size(group=group)
            layout, partition = self.bnb_layouts[i], masters[i].detach()
            error = errors[i]
            stock = ShardedLayout(layout.numels, dp, block=1)
            pieces = []
            for j in range(len(params)):
                mine = partition.narrow(0, layout.offsets[j], layout.slice_numel(j)).contiguous()
                if error is not None:  # the fp32 values the bf16 weights and their error terms stand for
                    mine = compensated.join(mine, error.narrow(0, layout.offsets[j], layout.slice_numel(j)))
                if dp == 1:
                    full = mine
                else:  # on the accelerator: with offload the partition is in host memory, which NCCL cannot send
                    mine = mine.to(get_accelerator().current_device_name())
                    full = torch.empty(mine.numel() * dp, dtype=mine.dtype, device=mine.device)
                    dist.allgather_fn(full, mine, group=group)  # all_gather_into_tensor, or a list on gloo
                pieces.append(full.narrow(0, rank * stock.slice_numel(j), stock.slice_numel(j)).to(partition.device))
            out.append(torch.cat(pieces))
        return out

    def step(self, closure=None):
        try:
            out = super().step(closure)
        finally:  # no sub-group's copy left pending (a step that raised between the kernel and the conversion)
            self.bnb_lp_copies.restore(self)
        self._bnb_agree_swaps("the optimizer step")  # with the optimizer on NVMe: every rank's swaps were whole
        return out

    def state_dict(self):
        # DeepSpeed refuses elastic_checkpoint at stage 3; the record below loads at any DP size either way
        self._bnb_refuse_after_swap_failure()  # the same on every rank: after an NVMe swap failed, no save
        state_dict = self._rigid_state_dict()
        records = self._bnb_group_records()
        self._bnb_check_whole_state(records)
        state_dict.pop(OPTIMIZER_STATE_DICT, None)  # bnb's own state_dict of the flat sub-groups: meaningless
        state_dict[C.FP32_FLAT_GROUPS_KEY] = self._bnb_stock_fp32_groups(records)
        self._bnb_agree_swaps("a checkpoint save")  # what was read from NVMe for it was whole on every rank
        state_dict[BASE_OPTIMIZER_STATE] = build_record(self._bnb_optimizer_class(), self.bnb.optimizer_name,
                                                        dist.get_rank(group=self.dp_process_group), records,
                                                        master_entry=C.FP32_FLAT_GROUPS_KEY,
                                                        master_mode=self.bnb_master.mode,
                                                        model_parallel=self.bnb_model_parallel)
        return state_dict

    def bnb_load_checkpoint(self, source, load_optimizer_states=True, load_from_fp32_weights=True):
        """Load from the per-rank states of a deepspeed_bnb checkpoint saved at any DP size and stage (sources.py)."""
        rank = dist.get_rank(group=self.dp_process_group)
        self.bnb_lp_copies.forget_whole()
        records = self._bnb_group_records()
        load_records(source, records, rank, self._bnb_optimizer_class(), load_optimizer_states,
                     load_from_fp32_weights)
        self._bnb_split_records(records)
        if load_from_fp32_weights:
            self._bnb_warn_master_change(source)
        self._load_global_state_stage3(source.state(rank if rank < source.dp else 0))
        if not load_from_fp32_weights:
            self._restore_from_bit16_weights()
        for i in range(len(self.fp16_groups)):  # the low-precision slices follow the fp32 master weights
            with self._bnb_resident(i):
                self._reassign_or_swap_out_partitioned_parameters(i)
        if self.persistent_parameters:  # gathered again by checkpoint_event_epilogue, from the new slices
            self.persistent_parameters[0].partition(self.persistent_parameters)
        self._bnb_agree_swaps("a checkpoint load")


def _aligned_sizes(params) -> List[int]:
    """Per parameter: the size DeepSpeed's reduction should see its gradient at (its partitions' total when block
    aligned, else the gradient's own)."""
    return [p.aligned_size() if is_block_aligned(p) else p.grad.numel() for p in params]


@contextlib.contextmanager
def _showing_grads(params, grads):
    """`param.grad` of each of `params` holds the matching one of `grads` for the block (through `.data`: a size
    other than the parameter's), and its own gradient again after it."""
    own = [p.grad.data for p in params]
    try:
        for param, grad in zip(params, grads):
            param.grad.data = grad
        yield
    finally:
        for param, grad in zip(params, own):
            param.grad.data = grad


def _joined(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The concatenation along the last dimension; the tensor itself when there is one (live, loaded in place)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=-1)
