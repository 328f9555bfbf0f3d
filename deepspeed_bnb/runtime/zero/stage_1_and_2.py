"""BnbZeroOptimizer: DeepSpeed's ZeRO stage-1/2 optimizer, made block-aware for bitsandbytes optimizer state.

Thin overrides of `deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer` (same module path here):
- `flatten_dense_tensors_aligned`: every parameter starts on a 256-element block, the group is padded to
  `256 * dp`, so partitions are block-aligned (state_layout.py); through DeepSpeed's per-parameter padding where the
  release has it, else through zero padding tensors between the parameters (runtime/zero/padding_tensors.py, chosen
  in runtime/zero/compat.py);
- `_optimizer_step`: per partition, the fused kernel steps the parameters whose bnb update it provably computes
  (optim/fused/contract.py: 8-bit state, bnb's own update_step, every config field modelled; DeepSpeed's unscale/clip
  factor folded in through `unscale_and_clip_grads`, runtime/zero/unscale_factor.py), and bnb's own `update_step`
  steps the others, segment by segment (optim/fused/partition_step.py, optim/bnb_adapter.py); 8-bit vs fp32 state is
  chosen per model parameter, and alignment padding is never updated, so it stays exactly zero;
- `has_overflow_partitioned_grads_serial` (the inf/NaN check before an fp16 or bf16 step): the same answer in a few
  batched operations instead of seven per gradient piece (runtime/utils.py);
- with the optimizer offloaded to the CPU, `update_offload_overflow_tracker` and
  `complete_grad_norm_calculation_for_cpu_offload`: DeepSpeed reads an inf/NaN test and the norm of every parameter's
  gradient back to the host one by one (a host sync each on a GPU); here the tests wait on the device until
  `has_overflow` reads them once, and the norms come to the host in one copy (runtime/utils.py);
- `step` and `_optimizer_step`, where the partition lives on the CPU (on a GPU where asked for): the fused kernel
  writes the model's copy of the updated weights, and DeepSpeed's conversion pass after the optimizer is made a no-op
  (runtime/zero/lp_copy.py);
- `_update_model_bit16_weights`, which DeepSpeed's step calls for every group to point the parameters at their flat
  buffer again: skipped where they still view what its last call left (runtime/zero/param_views.py);
- `_link_all_hp_params`: DeepSpeed's parameter-level optimizer-state API (`safe_get_full_optimizer_state`, ...) returns
  dequantized fp32 moments by bnb's and torch's names (utils/tensor_fragment.py);
- `state_dict`: a versioned, untrimmed per-rank record (checkpoint/) instead of ZeRO's element-wise
  trim/concatenate, which would corrupt quantization maps and per-block scales; it loads at any DP size through
  `bnb_load_checkpoint` (runtime/checkpointing.py routes `engine.load_checkpoint` there; `load_state_dict` refuses).
Everything else (gradient partitioning, reduction, clipping, loss scaling, all-gather, offload) is DeepSpeed's.
"""

from typing import List, Optional

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, DS_VERSION
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from deepspeed_bnb.checkpoint.format.constants import MASTER_WEIGHTS_KEY, PARAM_ALIGNMENT_PADDINGS
from deepspeed_bnb.checkpoint.format.experts import ExpertPlacement
from deepspeed_bnb.checkpoint.format.manifest import describe
from deepspeed_bnb.checkpoint.format.model_parallel import ALONE, ModelParallelPlace
from deepspeed_bnb.checkpoint.format.records import GroupRecord, build_record, load_records
from deepspeed_bnb.ops import compensated
from deepspeed_bnb.runtime.utils import any_inf_or_nan, inf_or_nan_term, on_host
from deepspeed_bnb.runtime.zero import padding_tensors
from deepspeed_bnb.runtime.zero.bnb_partitions import BnbPartitionsMixin
from deepspeed_bnb.runtime.zero.compat import PADDING_TENSORS, padding_mode, require_reduced_grad_accum, \
    wait_for_offload_copies
from deepspeed_bnb.runtime.zero.config import BnbSettings
from deepspeed_bnb.runtime.zero.expert_groups import expert_placements, record_names
from deepspeed_bnb.runtime.zero.lp_copy import LpCopies, zero12_copy
from deepspeed_bnb.runtime.zero.param_views import repoint
from deepspeed_bnb.runtime.zero.unscale_factor import StepFactor, as_step_scale
from deepspeed_bnb.state_layout import GroupLayout, zero_alignment
from deepspeed_bnb.utils.tensor_fragment import link_param_states


class BnbZeroOptimizer(BnbPartitionsMixin, DeepSpeedZeroOptimizer):
    """ZeRO-1/2 whose base optimizer is a bitsandbytes optimizer (8-bit or 32-bit state)."""

    # True while DeepSpeed's __init__ runs: its only calls of flatten_dense_tensors_aligned then flatten param groups
    _bnb_in_deepspeed_init = False
    # under CPU offload: the sum of the inf/NaN terms of the gradients DeepSpeed asked about since its last
    # reset_cpu_buffers (runtime/utils.py: inf_or_nan_term), not yet read; None: none pending
    _bnb_offload_overflow: Optional[torch.Tensor] = None

    def __init__(self, *args, bnb_settings: BnbSettings = BnbSettings(),
                 bnb_model_parallel: ModelParallelPlace = ALONE, **kwargs):
        kwargs = self._bnb_before_deepspeed(DeepSpeedZeroOptimizer, args, kwargs, bnb_settings,
                                            bnb_model_parallel)
        # how the block-aligned layout is placed in DeepSpeed's flat groups (compat.py)
        self.bnb_padding_mode = padding_mode()
        if self.bnb_padding_mode == PADDING_TENSORS:
            padding_tensors.refuse_unsupported(kwargs["init_optimizer"], kwargs)
        self._bnb_in_deepspeed_init = True
        try:
            super().__init__(**kwargs)
        finally:
            self._bnb_in_deepspeed_init = False
        # DeepSpeed before 0.19.8 does not average ZeRO-1's fp32 gradient accumulator across ranks (compat.py)
        require_reduced_grad_accum(self.use_grad_accum_attribute, dist.get_world_size(group=self.dp_process_group))
        self._bnb_after_deepspeed(self.single_partition_of_fp32_groups)
        self._bnb_inv_scale = {}  # group -> 1 / DeepSpeed's combined unscale/clip factor (a 0-dim tensor on the
        # partition's device), folded into the step
        self._bnb_unscale = StepFactor()  # the step's factor, as this release's unscale_and_clip_grads computes it
        self.bnb_lp_copies = LpCopies()  # the model's copies the fused kernel writes in place of DeepSpeed's pass
        # per param group: its model parameters in flat order (DeepSpeed's lists may hold padding tensors too)
        self.bnb_params: List[list] = [self.bnb_flat_params(i) for i in range(len(self.round_robin_bit16_groups))]
        for i, params in enumerate(self.bnb_params):
            layout = self._bnb_check_layout(i)
            rank = dist.get_rank(group=self.real_dp_process_group[i])
            # DeepSpeed derived its padding bookkeeping from its own layout; ours pads more.
            self.groups_padding[i] = layout.tail_padding(rank)
            self._bnb_add_partition(i, params, i, layout, rank)
        self._bnb_log_routes()  # self.bnb_routes: parameter name -> its Route
        # per param group: where an expert group's experts live (None: not an expert group), and the names its
        # record gives the parameters (global expert names)
        self.bnb_experts: List[Optional[ExpertPlacement]] = expert_placements(self)
        self.bnb_record_names: List[List[str]] = [record_names(self, i, placement)
                                                  for i, placement in enumerate(self.bnb_experts)]

    def bnb_flat_params(self, i) -> list:
        """The model parameters of param group `i` in flat order (DeepSpeed's list without padding tensors)."""
        return padding_tensors.real(self.round_robin_bit16_groups[i])

    def _bnb_partitions(self):
        return [(params, i, self.bnb_eight_bit[i]) for i, params in enumerate(self.bnb_params)]

    def _bnb_device(self):
        return self.single_partition_of_fp32_groups[0].device

    def bnb_partition_tensor(self, i):
        # mid-step, DeepSpeed's list may hold the model's copy in the master's place (lp_copy.py: LpCopies.hand_over)
        return self.bnb_lp_copies.handed.get(i, self.single_partition_of_fp32_groups[i])

    def bnb_partition_process_group(self, i):
        return self.real_dp_process_group[i]

    # ---- layout -------------------------------------------------------------------------------------------------

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False, param_padding=None):
        # DeepSpeedZeroOptimizer.__init__ calls this for one thing only, in every supported release (the register
        # records it): to flatten param group i, the list round_robin_bit16_groups[i], right after appending the
        # group's lists (flat order, meta tensors, and from 0.19.7 on the per-parameter padding and offsets); every
        # later consumer (gradient partitioning, hp mapping, offload, checkpoint) follows those lists. Rewriting them
        # here chooses the layout without copying __init__. Calls after __init__ (the step's gradient partition)
        # pass through.
        if not self._bnb_in_deepspeed_init:
            return self._bnb_stock_flatten(tensor_list, alignment, use_cpu_data, param_padding)
        i = next((k for k, group in enumerate(self.round_robin_bit16_groups) if group is tensor_list), None)
        if i is None:
            import deepspeed
            raise RuntimeError(f"deepspeed_bnb: DeepSpeed {deepspeed.__version__}'s DeepSpeedZeroOptimizer.__init__ "
                               f"flattened a list that is not one of its param groups ({len(tensor_list)} tensors): "
                               f"this release builds its flat groups another way than deepspeed_bnb supports. Use a "
                               f"DeepSpeed version listed in docs/versions.md.")
        with torch.no_grad():  # a leaf buffer on every release (0.18.7-0.18.9 flatten the parameters: compat.py)
            return self._bnb_flatten_group(i, tensor_list, alignment, use_cpu_data, param_padding)

    def _bnb_flatten_group(self, i, tensor_list, alignment, use_cpu_data, param_padding):
        layout = self._bnb_layout(i)
        paddings = [slot.padding for slot in layout.slots]
        alignment = zero_alignment(alignment, layout)
        if self.bnb_padding_mode == PADDING_TENSORS:
            tensor_list = padding_tensors.place(self, i, paddings, use_cpu_data)
            if param_padding is not None:  # a release with per-parameter padding: none of its own, the gaps are tensors
                param_padding[:] = [0] * len(tensor_list)
                self.round_robin_bit16_offsets[i][:] = _running_offsets(self.round_robin_bit16_meta[i])
        elif param_padding is not None:
            if self.round_robin_bit16_padding[i] is not param_padding:
                raise RuntimeError("deepspeed_bnb: DeepSpeedZeroOptimizer.__init__ no longer flattens groups the "
                                   "way this version expects; use a supported DeepSpeed version.")
            param_padding[:] = paddings
            self.round_robin_bit16_offsets[i][:] = [slot.offset for slot in layout.slots]
        return self._bnb_stock_flatten(tensor_list, alignment, use_cpu_data, param_padding)

    def _bnb_stock_flatten(self, tensor_list, alignment, use_cpu_data, param_padding):
        if param_padding is None:  # releases before per-parameter padding have no such argument
            return super().flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data)
        return super().flatten_dense_tensors_aligned(tensor_list, alignment, use_cpu_data, param_padding)

    def _bnb_layout(self, i) -> GroupLayout:
        # meta tensors: parameter data may already be swapped out for CPU flattening
        return GroupLayout(numels=tuple(m.numel() for p, m in zip(self.round_robin_bit16_groups[i],
                                                                  self.round_robin_bit16_meta[i])
                                        if not padding_tensors.is_padding(p)),
                           dp=dist.get_world_size(group=self.real_dp_process_group[i]))

    def _bnb_flat_offsets(self, i) -> List[int]:
        """Where DeepSpeed placed each model parameter of group `i` in its flat buffer."""
        paddings = getattr(self, "round_robin_bit16_padding", None)  # DeepSpeed >= 0.19.7
        offsets, at = [], 0
        for k, (param, meta) in enumerate(zip(self.round_robin_bit16_groups[i], self.round_robin_bit16_meta[i])):
            if not padding_tensors.is_padding(param):
                offsets.append(at)
            at += meta.numel() + (paddings[i][k] if paddings else 0)
        return offsets

    def _bnb_check_layout(self, i) -> GroupLayout:
        layout = self._bnb_layout(i)
        if (self.bit16_groups_flat[i].numel() != layout.total_numel
                or self._bnb_flat_offsets(i) != [s.offset for s in layout.slots]
                or self.partition_size[i] != layout.partition_size):
            raise RuntimeError(f"deepspeed_bnb: param group {i} was not flattened block-aligned "
                               f"({self.bit16_groups_flat[i].numel()} elements, expected {layout.total_numel}).")
        return layout

    def _bnb_check_trust_ratio(self, i, layout: GroupLayout, eight_bit):
        # bnb's fp32 LAMB/LARS path scales each update by a per-tensor norm ratio; computed on a segment it would be
        # wrong, so a parameter that needs it must lie inside one partition (bnb's 8-bit paths ignore max_unorm).
        for slot, params in zip(layout.slots, self.bnb_params[i]):
            split = slot.offset // layout.partition_size != (slot.offset + slot.numel - 1) // layout.partition_size
            if split and not eight_bit[slot.index] and self.bnb.max_unorm(params) > 0:
                name = self.param_names.get(params, f"#{slot.index}")
                raise NotImplementedError(
                    f"deepspeed_bnb: parameter {name} ({slot.numel} elements, fp32 state) is split across ZeRO "
                    f"ranks, but {type(self.optimizer).__name__} applies a per-tensor trust ratio "
                    f"(max_unorm={self.bnb.max_unorm(params)}) to fp32 state. Use 8-bit state for it (lower "
                    f"min_8bit_size), max_unorm=0, or fewer data-parallel ranks.")

    def _update_model_bit16_weights(self, group_index):
        # DeepSpeed's step ends by re-pointing every parameter of every group at its flat buffer, as a precaution
        # (two .data assignments per parameter): run only where the last call's views moved since (param_views.py)
        repoint(self, group_index, self.bit16_groups_flat[group_index],
                lambda: super(BnbZeroOptimizer, self)._update_model_bit16_weights(group_index),
                lambda: [*self.round_robin_bit16_groups[group_index], *self.bit16_groups[group_index]])

    def _link_all_hp_params(self):
        # DeepSpeed's fragments would hand out uint8 codes as moments (safe_get_full_optimizer_state); route state keys
        # through bnb state instead, dequantized and requantized (utils/tensor_fragment.py).
        if self.bnb_padding_mode == PADDING_TENSORS:
            with padding_tensors.flat_order(self):  # DeepSpeed counts offsets along the list it links
                super()._link_all_hp_params()
            padding_tensors.unlink(self)
        else:
            super()._link_all_hp_params()
        link_param_states(self)

    # ---- step ---------------------------------------------------------------------------------------------------

    def has_overflow_partitioned_grads_serial(self):
        # DeepSpeed tests each gradient piece with seven small operations (a kernel launch each on a GPU), summed
        # into a count; the same answer from one fp64 norm per piece, batched (runtime/utils.py says why it is exact)
        return any_inf_or_nan((grad for i in range(len(self.bit16_groups)) for grad in self.averaged_gradients[i]),
                              get_accelerator().current_device_name())

    # ---- CPU offload: DeepSpeed's per-parameter host reads, batched -------------------------------------------

    def update_offload_overflow_tracker(self, grad):
        # DeepSpeed (0.17.1 on) asks `if grad is not None and self._has_inf_or_nan(grad.data)` for every parameter's
        # gradient during backward: a host read each. The test's term waits on the device instead; has_overflow, the
        # only reader of local_overflow, reads their sum once (with overlap_comm the terms are made on DeepSpeed's
        # reduction stream, which its backward epilogue synchronizes before any step)
        if grad is not None:
            term = inf_or_nan_term(grad.data)
            pending = self._bnb_offload_overflow
            self._bnb_offload_overflow = term if pending is None else pending + term

    def has_overflow(self, partition_gradients=True):
        pending, self._bnb_offload_overflow = self._bnb_offload_overflow, None
        if pending is not None and not bool(pending.isfinite()):
            self.local_overflow = True
        return super().has_overflow(partition_gradients)

    def reset_cpu_buffers(self):
        super().reset_cpu_buffers()  # local_overflow = False
        self._bnb_offload_overflow = None

    def complete_grad_norm_calculation_for_cpu_offload(self, params):
        # DeepSpeed sums `self.norm_for_param_grads[id].item() ** 2` over the parameters: a host read each. Its own
        # loop runs here on copies brought to the host in one transfer: the same doubles, in the same order, summed
        # by the same Python arithmetic
        norms = self.norm_for_param_grads
        copies = on_host(norms)
        if copies is None:
            return super().complete_grad_norm_calculation_for_cpu_offload(params)
        self.norm_for_param_grads = copies
        try:
            return super().complete_grad_norm_calculation_for_cpu_offload(params)
        finally:
            self.norm_for_param_grads = norms

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        # DeepSpeed's step multiplies the gradient partition of group i by 1 / (loss scale * clip) here, just before
        # _optimizer_step(i): the partition's step folds that factor into the kernel's pass instead, and multiplies
        # only the segments bnb steps (runtime/zero/unscale_factor.py). Any other gradients are multiplied here, as
        # DeepSpeed does.
        factor = self._bnb_unscale(self, total_norm)
        for i, partition in enumerate(self.single_partition_of_fp32_groups):
            if len(grad_groups_flat) == 1 and grad_groups_flat[0] is partition.grad:
                self._bnb_inv_scale[i] = as_step_scale(factor, partition.grad.device)
                return
        if factor is not None:
            for grad in grad_groups_flat:
                for g in grad if isinstance(grad, list) else [grad]:
                    g.data.mul_(factor)

    def step(self, closure=None):
        try:
            return super().step(closure)
        finally:  # the master partitions handed out for DeepSpeed's copy statements back in place (lp_copy.py)
            self.bnb_lp_copies.restore(self)

    def _optimizer_step(self, group_no):
        partition = self.single_partition_of_fp32_groups[group_no]
        copy = self.bnb_lp_copies.target(self, group_no, zero12_copy(self, group_no))
        written = self.bnb_steps[group_no].step(self.optimizer.param_groups[group_no], partition, partition.grad,
                                                self.optimizer.state[partition],
                                                self._bnb_inv_scale.pop(group_no, None),
                                                self.bnb_master_errors[group_no], lp_params=copy)
        self._lazy_init_hp_params_optimizer_state()
        if written:  # the kernel wrote the model's copy: DeepSpeed's conversion right after this becomes a no-op
            self.bnb_lp_copies.hand_over(self, group_no, copy)

    # ---- accounting ---------------------------------------------------------------------------------------------

    def bnb_description(self) -> dict:
        """What a checkpoint manifest records about the run that wrote it."""
        return describe(self._bnb_optimizer_class(), 2 if self.partition_gradients else 1,
                        dist.get_world_size(group=self.dp_process_group),
                        [(names, layout.numels, eight_bit)
                         for names, layout, eight_bit in zip(self.bnb_record_names, self.bnb_layouts,
                                                             self.bnb_eight_bit)], self.bnb_master.mode)

    # ---- checkpoint ---------------------------------------------------------------------------------------------

    def _bnb_group_records(self) -> List[GroupRecord]:
        records = []
        for i, params in enumerate(self.bnb_params):
            partition = self.single_partition_of_fp32_groups[i]
            state = self.optimizer.state[partition]
            records.append(GroupRecord(hyperparams=self.optimizer.param_groups[i], layout=self.bnb_layouts[i],
                                       param_names=self.bnb_record_names[i], eight_bit=self.bnb_eight_bit[i],
                                       key_classes=self.bnb.stored_classes(state), state=state,
                                       master=partition.data, master_error=self.bnb_master_errors[i],
                                       expert=self.bnb_experts[i]))
        return records

    def state_dict(self):
        state_dict = super().state_dict()
        records = self._bnb_group_records()
        self._bnb_check_whole_state(records)
        state_dict.pop(BASE_OPTIMIZER_STATE_STEP, None)
        # DeepSpeed >= 0.19.7 records the per-parameter padding of each group (zero_to_fp32 skips it); the same
        # from the layout on every release and padding mode, so the files do not depend on either
        state_dict[PARAM_ALIGNMENT_PADDINGS] = [[slot.padding for slot in layout.slots] for layout in self.bnb_layouts]
        state_dict[BASE_OPTIMIZER_STATE] = build_record(self._bnb_optimizer_class(), self.bnb.optimizer_name,
                                                        dist.get_rank(group=self.dp_process_group), records,
                                                        master_mode=self.bnb_master.mode,
                                                        model_parallel=self.bnb_model_parallel)
        if self.bnb_master.compensated:  # the fp32 values the bf16 weights and their error terms stand for
            state_dict[MASTER_WEIGHTS_KEY] = [
                compensated.join(saved.cpu(), error.narrow(0, 0, saved.numel()).cpu())
                for saved, error in zip(state_dict[MASTER_WEIGHTS_KEY], self.bnb_master_errors)]
        return state_dict

    def bnb_load_checkpoint(self, source, load_optimizer_states=True, load_from_fp32_weights=True):
        """Load from the per-rank states of a deepspeed_bnb checkpoint saved at any DP size (sources.py)."""
        wait_for_offload_copies(self)
        self.bnb_lp_copies.forget_whole()
        rank = dist.get_rank(group=self.dp_process_group)
        load_records(source, self._bnb_group_records(), rank, self._bnb_optimizer_class(), load_optimizer_states,
                     load_from_fp32_weights)
        if load_from_fp32_weights:
            self._bnb_warn_master_change(source)
        self._load_global_state(_with_version(source, rank if rank < source.dp else 0))
        if not load_from_fp32_weights:
            self._restore_from_bit16_weights()
        else:  # the model weights follow the loaded fp32 master weights (a stage-3 file holds no module weights)
            self.update_lp_params()
        if load_optimizer_states:
            self._link_all_hp_params()


def _running_offsets(metas) -> List[int]:
    """Offsets of tensors laid back to back."""
    offsets, at = [], 0
    for meta in metas:
        offsets.append(at)
        at += meta.numel()
    return offsets


def _with_version(source, rank) -> dict:
    """A rank's ZeRO state for `_load_global_state`, which requires DeepSpeed's version inside it: stage-1/2 state
    dicts carry it, stage-3 ones do not (the file around them does)."""
    state = source.state(rank)
    if DS_VERSION not in state and hasattr(source, "blob"):
        state = {**state, DS_VERSION: source.blob(rank).get(DS_VERSION)}
    return state
