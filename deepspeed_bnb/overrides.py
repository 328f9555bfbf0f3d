"""The register of everything deepspeed_bnb changes in, or privately relies on from, DeepSpeed and Accelerate.

Each entry names one symbol once: its owner and name, what deepspeed_bnb does with it (`how`), for how long
(`scope`), the replacement, why, and the parameters relied on, with the releases where a parameter or the symbol
itself exists. This module is data (and the table docs/overrides.md shows); installer.py acts on it: nothing else in
the package assigns to a DeepSpeed or Accelerate module or class: the import-scope replacements are installed by
`installer.activate()` (called by `import deepspeed_bnb`) and taken back by `installer.stock_deepspeed()`; call-scope
swaps go through `installer.swapped()`; the rest are overrides in deepspeed_bnb's ZeRO subclasses, attributes set on
objects deepspeed_bnb creates or links, and private methods it calls. Release differences are data here (`since`,
`params_since`); runtime/zero/compat.py turns them into behaviour.

tests/unit/test_overrides.py checks, for the installed release, that every entry that should exist does, with the
parameters listed (and that a symbol or parameter marked `since` a later release is indeed absent), that every
DeepSpeed method deepspeed_bnb's ZeRO classes override is registered, and that `stock_deepspeed()` restores every
replaced symbol. The compatibility matrix (tools/compat_matrix.py) runs that test against every supported release,
which is what `CHECKED` records. This module imports nothing from DeepSpeed until something is resolved.
"""

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from packaging.version import Version

CHECKED = ("0.16.4", "0.19.8")  # DeepSpeed releases every entry was checked against (tools/compat_matrix.md)

# how
REPLACE = "replace"  # our function or class installed in the owner, DeepSpeed's kept (`stock`) and usually called
SWAP = "swap"  # replaced for the duration of one call of ours (scope "call"), then restored
SUBCLASS = "subclass"  # a method of DeepSpeed's ZeRO class that deepspeed_bnb's subclass overrides
OBJECT = "object"  # an attribute deepspeed_bnb sets on objects it creates or links (parameters, optimizers)
CALL = "call"  # a private DeepSpeed method or attribute deepspeed_bnb calls or reads, unchanged
# scope
IMPORT_SCOPE = "import"  # from activate() on (Accelerate's: from the moment Accelerate itself is imported)
CALL_SCOPE = "call"  # for the duration of one call of deepspeed_bnb's
OBJECT_SCOPE = "object"  # on one object, for its lifetime


@dataclass(frozen=True)
class Override:
    owner: str  # dotted path of the module, or module.Class, that holds the symbol
    name: str  # the attribute (a name-mangled private method under its mangled name)
    how: str  # REPLACE, SWAP, SUBCLASS, OBJECT or CALL
    scope: str  # IMPORT_SCOPE, CALL_SCOPE or OBJECT_SCOPE
    replacement: str  # "module:qualname" of deepspeed_bnb's side ("" for CALL)
    why: str  # the DeepSpeed / Accelerate behaviour this works around or relies on
    params: Optional[Tuple[str, ...]] = None  # parameter names relied on, in order (None: not checked as a callable)
    params_since: Dict[str, str] = field(default_factory=dict)  # parameter -> first release that has it
    since: str = ""  # first release that has the symbol ("": every supported release)
    trigger: str = ""  # for IMPORT_SCOPE entries outside DeepSpeed: the module whose import installs it

    @property
    def key(self) -> str:
        """Short unique name: the owner's last component and the attribute, e.g. "DeepSpeedEngine.save_checkpoint"."""
        return f"{self.owner.rsplit('.', 1)[-1]}.{self.name}"

    def exists_in(self, release: str) -> bool:
        return not self.since or Version(release) >= Version(self.since)


ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
ZERO3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
PARTITION = "deepspeed.runtime.zero.partition_parameters"
FRAGMENT = "deepspeed.utils.tensor_fragment"
ENGINE_PY, ZERO12_PY, ZERO3_PY = ("deepspeed_bnb.runtime.engine", "deepspeed_bnb.runtime.zero.stage_1_and_2",
                                  "deepspeed_bnb.runtime.zero.stage3")
CHECKPOINTING_PY = "deepspeed_bnb.runtime.checkpointing"
MIXIN_PY = "deepspeed_bnb.runtime.zero.bnb_partitions"  # what the ZeRO subclasses of every stage share
NVME_PY = "deepspeed_bnb.runtime.zero.nvme_state"  # ZeRO-3's bnb state on NVMe
PADDING_PY = "deepspeed_bnb.runtime.zero.padding_tensors"


def _engine(name, why, params, module=ENGINE_PY, **kw):
    return Override(ENGINE, name, REPLACE, IMPORT_SCOPE, f"{module}:{name}", why, params, **kw)


def _checkpointing(name, why, params, **kw):
    return _engine(name, why, params, module=CHECKPOINTING_PY, **kw)


def _subclass(owner, ours, name, why, params, **kw):
    return Override(owner, name, SUBCLASS, IMPORT_SCOPE, f"{ours}:{name}", why, params, **kw)


OVERRIDES: Tuple[Override, ...] = (
    # ---- DeepSpeedEngine: routing a bnb optimizer to deepspeed_bnb's ZeRO classes, checkpoints ------------------
    _engine("_configure_optimizer", "refuse a bnb optimizer that another route of this DeepSpeed built into stock "
            "ZeRO (it would shard quantization state element-wise)", ("self", "client_optimizer", "model_parameters")),
    _engine("_configure_zero_optimizer", "DeepSpeed instantiates its ZeRO classes by module-level name inside this "
            "method: for a bnb optimizer the names are swapped for the call (entries below)", ("self", "optimizer")),
    _engine("_do_optimizer_sanity_check", "bf16 + fp32 gradient accumulation + ZeRO-1 would pick BF16_Optimizer, "
            "which shards bnb state element-wise; bnb optimizers go to ZeRO instead", ("self", "basic_optimizer")),
    _checkpointing("_load_zero_checkpoint", "stock loading refuses another DP size and concatenates state "
                   "element-wise; bnb engines load their per-rank records at any DP size",
                   ("self", "load_dir", "tag", "load_optimizer_states")),
    _checkpointing("_get_all_ckpt_names", "at stage 3 a rank beyond the saving DP size, or a checkpoint of the other "
                   "stage family, has no model-states file of its own name", ("self", "checkpoints_path", "tag")),
    _checkpointing("load_module_state_dict", "module weights of the other stage family: gathered into ZeRO-3, or "
                   "rebuilt through the safe loader instead of zero_to_fp32's full unpickling; frozen parameters set "
                   "from their full saved weights at this DP size (stock copies each rank's saved ZeRO-3 slice); a "
                   "PipelineEngine's module dict taken as the checkpoint it hands on (stock: KeyError 'module')",
                   ("self", "checkpoint", "strict", "custom_load_fn", "fetch_z3_params"),
                   params_since={"z3_params_to_fetch": "0.19.3", "allowed_missing_keys": "0.19.3"}),
    _checkpointing("save_checkpoint", "crash-safe publishing with a checksummed manifest under the save directory's "
                   "lock; a save that fails on one rank (cannot start, a full disk, the publish) fails on every rank",
                   ("self", "save_dir", "tag", "client_state", "save_latest", "exclude_frozen_parameters")),
    _checkpointing("load_checkpoint", "for bnb engines, and any engine loading a deepspeed_bnb tag: verify the "
                   "manifest, read every file through the safe loader, check the optimizer state fits before "
                   "DeepSpeed replaces module weights, agree on failures across ranks",
                   ("self", "load_dir", "tag", "load_module_strict", "load_optimizer_states",
                    "load_lr_scheduler_states", "load_module_only", "custom_load_fn")),
    _engine("_get_zero_param_shapes", "names every entry of the ZeRO flat lists; padding tensors (releases without "
            "per-parameter padding) are hidden so the model states are the same on every release", ("self",)),
    Override("deepspeed.runtime.engine", "is_zero_supported_optimizer", REPLACE, IMPORT_SCOPE,
             f"{ENGINE_PY}:_is_zero_supported_optimizer", "bnb optimizers (custom subclasses too) are supported: "
             "their state is classified key by key, zero_allow_untested_optimizer is not needed", ("optimizer",)),
    Override("deepspeed.runtime.engine", "DeepSpeedZeroOptimizer", SWAP, CALL_SCOPE, f"{ZERO12_PY}:BnbZeroOptimizer",
             "the name _configure_zero_optimizer instantiates for stages 1/2; swapped during that call only"),
    Override("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", SWAP, CALL_SCOPE,
             f"{ZERO3_PY}:BnbZeroStage3Optimizer", "the name _configure_zero_optimizer instantiates for stage 3 "
             "(imported inside it from this module); swapped during that call only"),
    Override(ENGINE, "_get_rank_zero_ckpt_name", CALL, CALL_SCOPE, "", "the name of each rank's optimizer file, to "
             "read the files a new rank needs at any DP size",
             ("self", "checkpoints_path", "tag", "mp_rank", "dp_rank", "bf16_mode")),
    Override(ENGINE, "checkpoint_mp_rank", CALL, OBJECT_SCOPE, "", "the model-parallel rank in checkpoint file names "
             "(before it, from the engine's mpu)", since="0.19.6"),
    Override(ENGINE, "super_offload", CALL, CALL_SCOPE, "", "SuperOffload steps with DeepSpeedCPUAdam: refused for "
             "bnb optimizers", ("self",), since="0.18.0"),
    Override("deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine", "load", SWAP, CALL_SCOPE,
             f"{CHECKPOINTING_PY}:_safe_reads", "DeepSpeed reads model states through the engine's "
             "checkpoint_engine.load (full pickle); replaced on that object for the duration of a load by the safe "
             "loader", ("self", "path", "map_location")),
    Override("deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine", "save", SWAP, CALL_SCOPE,
             f"{CHECKPOINTING_PY}:_DeferredWrites", "a write that fails on one rank would raise there while the other "
             "ranks wait in DeepSpeed's closing barrier; replaced on that object for the duration of a save by one "
             "that records the failure, which every rank then raises", ("self", "state_dict", "path")),
    Override(ENGINE, "zero_nvme_offload_optimizer", SWAP, CALL_SCOPE, f"{CHECKPOINTING_PY}:not_stock_nvme",
             "with the optimizer offloaded to NVMe, DeepSpeed saves a copy of its swap folder beside the checkpoint "
             "and loads by copying it back over the swap folder instead of loading the ZeRO checkpoint (the same DP "
             "size only; the saved fp32 partitions are empty); a bnb engine's per-rank records hold its state and "
             "master weights, so for a bnb engine's save and load it answers False", ("self",)),
    Override("deepspeed.runtime.engine", "get_fp32_state_dict_from_zero_checkpoint", SWAP, CALL_SCOPE,
             f"{CHECKPOINTING_PY}:_safe_reads", "ZeRO-3 weights-only loads rebuild the weights with zero_to_fp32, "
             "which unpickles every rank file in full, globs the tag for files and re-reads `latest` whatever tag "
             "was asked for; during a load it returns the loaded tag's weights, read through the safe loader",
             ("checkpoint_dir",)),
    Override("deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine", "is_decoupled", CALL,
             CALL_SCOPE, "", "a decoupled writer finishes files after save_checkpoint returns: no manifest then",
             ("self",), since="0.17.1"),
    Override("deepspeed.comm", "all_gather_object", CALL, CALL_SCOPE, "", "every rank learns every rank's outcome "
             "of a checkpoint step (before it, torch.distributed's)", ("object_list", "obj", "group"),
             since="0.17.0"),
    # ---- ZeRO config ----------------------------------------------------------------------------------------------
    Override("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.config:BnbZeroConfig", "the pydantic model forbids unknown keys, and HF "
             "Trainer / Accelerate parse configs long before deepspeed.initialize: the bnb_* keys must be part of the "
             "model get_zero_config builds"),
    # ---- ZeRO-1/2: DeepSpeedZeroOptimizer, overridden by BnbZeroOptimizer -------------------------------------
    _subclass(ZERO12, ZERO12_PY, "__init__", "resolves per-parameter precision before DeepSpeed replaces the "
              "groups' params with flat partitions; asks for bf16 master weights where bnb_master_weights does",
              ("self", "init_optimizer", "param_names"),
              params_since={"bf16_master_weights_and_gradients": "0.18.3"}),
    _subclass(ZERO12, MIXIN_PY, "_configure_master_weights", "bf16 master weights without DeepSpeedCPUAdam: its "
              "check guards fp32 moments, which 8-bit state is not; bf16_optimizer_states is ignored with a warning",
              ("self", "fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients",
               "bf16_optimizer_states"), since="0.18.3"),
    _subclass(ZERO12, MIXIN_PY, "_restore_from_bit16_weights", "the master weights become the model's bf16 weights: "
              "compensated ones lose their error terms", ("self",)),
    _subclass(ZERO12, ZERO12_PY, "flatten_dense_tensors_aligned", "chooses the block-aligned layout when __init__ "
              "flattens a group (every call during DeepSpeed's __init__ is one: the group is found by identity in "
              "round_robin_bit16_groups, anything else is refused): rewrites the per-parameter padding, or places "
              "padding tensors; flattens without autograd (0.18.7-0.18.9 flatten the parameters themselves: a buffer "
              "requiring grad); later calls pass through",
              ("self", "tensor_list", "alignment", "use_cpu_data"), params_since={"param_padding": "0.19.7"}),
    _subclass(ZERO12, ZERO12_PY, "_update_model_bit16_weights", "DeepSpeed's step re-points every parameter at its "
              "group's flat buffer as a precaution (two .data assignments per parameter, every step): skipped where "
              "the buffer and every tensor it assigns still look as its last call left them "
              "(runtime/zero/param_views.py), else DeepSpeed's own", ("self", "group_index")),
    Override(ZERO12, "bit16_groups_flat", CALL, OBJECT_SCOPE, "", "each group's flat buffer of model weights (read: "
             "whether DeepSpeed's re-pointing would change anything)"),
    _subclass(ZERO12, ZERO12_PY, "_link_all_hp_params", "state keys answered from bnb state, dequantized; with "
              "padding tensors, linked along the flat order", ("self",)),
    _subclass(ZERO12, ZERO12_PY, "unscale_and_clip_grads", "owned: the combined unscale/clip factor, computed as "
              "each release range computes it (unscale_factor.combined_unscale_factor; the ranges in compat.py), is "
              "folded into the partition's step instead of a separate pass, without a host read of the norm; "
              "tests/kernels/test_matches_bnb.py holds it equal to DeepSpeed's own method on every release the "
              "matrix runs",
              ("self", "grad_groups_flat", "total_norm")),
    _subclass(ZERO12, ZERO12_PY, "_optimizer_step", "steps the partition segment by segment (fused kernel or bnb's "
              "update per parameter); on the CPU (on a GPU where asked for) the kernel writes the model's copy of the "
              "updated weights, and the "
              "group's master entry is handed over for DeepSpeed's conversion statement right after, which then copies "
              "the copy onto itself (runtime/zero/lp_copy.py)", ("self", "group_no")),
    _subclass(ZERO12, ZERO12_PY, "step", "DeepSpeed's step, then the master partitions handed over for its "
              "conversion statements back in place (also when it raises)", ("self", "closure")),
    Override(ZERO12, "single_partition_of_fp32_groups", CALL, OBJECT_SCOPE, "", "each group's fp32 master partition "
             "(read; during a step an entry is the model's copy between _optimizer_step and DeepSpeed's conversion "
             "statement, which reads it there only: lp_copy.py)"),
    Override(ZERO12, "param_buffer_of_bit16_for_cpu_offload_groups", CALL, OBJECT_SCOPE, "", "under CPU offload, the "
             "pinned buffer DeepSpeed converts each master partition into and sends to the device: the fused CPU "
             "kernel writes it (where it is missing, DeepSpeed sends the fp32 partition and converts it itself)",
             since="0.17.0"),
    Override(ZERO12, "parallel_partitioned_bit16_groups", CALL, OBJECT_SCOPE, "", "each group's model-weight "
             "partitions (this rank's: the copy the fused kernel writes without offload)"),
    _subclass(ZERO12, ZERO12_PY, "has_overflow_partitioned_grads_serial", "the inf/NaN check before an fp16/bf16 "
              "step: the same answer (a bool tensor of shape [1] on the device, as every supported release returns "
              "it) from one batched fp64 norm per gradient piece on a GPU, each piece's smallest and largest values "
              "on the CPU, instead of seven operations per piece (runtime/utils.py: any_inf_or_nan); "
              "tests/unit/test_overflow_check.py holds it to DeepSpeed's own",
              ("self",)),
    Override(ZERO12, "averaged_gradients", CALL, OBJECT_SCOPE, "", "the gradient pieces of each param group "
             "(read by the inf/NaN check, as DeepSpeed's own reads them)"),
    _subclass(ZERO12, ZERO12_PY, "update_offload_overflow_tracker", "under CPU offload DeepSpeed reads an inf/NaN "
              "test of every parameter's gradient back to the host during backward (a host sync each on a GPU): the "
              "test's term (an fp64 norm; on the CPU the gradient's largest minus smallest value) is summed on the "
              "device instead (runtime/utils.py: inf_or_nan_term)",
              ("self", "grad"), since="0.17.1"),
    _subclass(ZERO12, ZERO12_PY, "has_overflow", "reads the summed offload terms once (into local_overflow, which "
              "only this method reads), then DeepSpeed's own", ("self", "partition_gradients")),
    _subclass(ZERO12, ZERO12_PY, "reset_cpu_buffers", "drops the pending offload terms where DeepSpeed resets "
              "local_overflow", ("self",)),
    _subclass(ZERO12, ZERO12_PY, "complete_grad_norm_calculation_for_cpu_offload", "DeepSpeed reads each "
              "parameter's gradient norm with .item() (a host sync each on a GPU): its own loop runs on host copies "
              "made in one transfer (runtime/utils.py: on_host)", ("self", "params")),
    Override(ZERO12, "local_overflow", CALL, OBJECT_SCOPE, "", "the offload overflow flag has_overflow reads "
             "(set here from the pending terms)"),
    Override(ZERO12, "norm_for_param_grads", CALL, OBJECT_SCOPE, "", "parameter id -> its gradient's norm, a 0-dim "
             "tensor (replaced by host copies for the duration of the norm's loop)"),
    _subclass(ZERO12, ZERO12_PY, "state_dict", "writes the versioned per-rank record instead of element-wise "
              "trimmed state", ("self",)),
    _subclass(ZERO12, ZERO12_PY, "load_state_dict", "refused: loading goes through engine.load_checkpoint",
              ("self", "state_dict_list")),
    Override(ZERO12, "_load_global_state", CALL, CALL_SCOPE, "", "loss scaler, clip and version from a rank's state",
             ("self", "sd")),
    Override(ZERO12, "update_lp_params", CALL, CALL_SCOPE, "", "model weights follow the loaded master weights",
             ("self",)),
    Override(ZERO12, "_lazy_init_hp_params_optimizer_state", CALL, CALL_SCOPE, "", "after each step, as DeepSpeed's "
             "own _optimizer_step does", ("self",)),
    Override(ZERO12, "_wait_for_offload_copies", CALL, CALL_SCOPE, "", "asynchronous copies to the offload buffers "
             "must finish before a load overwrites state", ("self",), since="0.19.8"),
    Override(ZERO12, "round_robin_bit16_groups", CALL, OBJECT_SCOPE, "", "the flat order of each group (read; with "
             "padding tensors, rewritten while the group is flattened)"),
    Override(ZERO12, "round_robin_bit16_meta", CALL, OBJECT_SCOPE, "", "numels in flat order (parameter data may be "
             "swapped out while flattening)"),
    Override(ZERO12, "round_robin_bit16_padding", CALL, OBJECT_SCOPE, "", "per-parameter padding, rewritten to the "
             "block-aligned layout while the group is flattened", since="0.19.7"),
    Override(ZERO12, "round_robin_bit16_offsets", CALL, OBJECT_SCOPE, "", "offsets of the per-parameter padding "
             "layout, rewritten with it", since="0.19.7"),
    Override(ZERO12, "groups_padding", CALL, OBJECT_SCOPE, "", "DeepSpeed derives it from its own layout; set from "
             "the block-aligned one"),
    Override(ZERO12, "torch_autocast_gradscaler", CALL, OBJECT_SCOPE, "", "torch autocast with a GradScaler is "
             "refused", since="0.17.2"),
    Override(ZERO12, "bit16_groups", SWAP, CALL_SCOPE, f"{PADDING_PY}:flat_order", "with padding tensors, "
             "DeepSpeed's link_hp_params counts offsets along bit16_groups: it is the flat order during the link, "
             "and the model's parameters only while DeepSpeedEngine._get_zero_param_shapes names them"),
    Override("deepspeed.utils.mixed_precision_linkage", "link_hp_params", OBJECT, OBJECT_SCOPE,
             f"{PADDING_PY}:unlink", "gives every parameter of the list it is handed an _hp_mapping; padding tensors' "
             "are dropped again (_param_slice_mappings names every linked parameter)",
             ("lp_param_list", "flat_hp_partition")),
    # ---- ZeRO-3: DeepSpeedZeroOptimizer_Stage3, overridden by BnbZeroStage3Optimizer --------------------------
    _subclass(ZERO3, ZERO3_PY, "__init__", "marks the bnb parameters for block-aligned partitions before DeepSpeed "
              "partitions them; asks for bf16 master weights where bnb_master_weights does",
              ("self", "module", "init_optimizer"),
              params_since={"param_names": "0.18.0", "bf16_master_weights_and_gradients": "0.18.3"}),
    _subclass(ZERO3, MIXIN_PY, "_configure_master_weights", "as at stages 1/2",
              ("self", "fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients",
               "bf16_optimizer_states"), since="0.18.3"),
    _subclass(ZERO3, ZERO3_PY, "_restore_from_bit16_weights", "as at stages 1/2; with the optimizer on NVMe, one "
              "sub-group in memory at a time (DeepSpeed copies into the empty placeholders of swapped partitions)",
              ("self",)),
    _subclass(ZERO3, NVME_PY, "_configure_tensor_swapping", "DeepSpeed's optimizer swapper takes every state tensor "
              "of 1 MiB or more for an fp32 moment of the partition's size (bnb's uint8 codes are read back from files "
              "never written): it is narrowed to the fp32 partitions and gradients, and bnb's state goes to "
              "deepspeed_bnb's own swapper", ("self", "offload_optimizer_config", "aio_config")),
    Override("deepspeed.runtime.swap_tensor.optimizer_utils.OptimizerSwapper", "_get_state_tensors", OBJECT,
             OBJECT_SCOPE, f"{NVME_PY}:BnbNVMeStateMixin._configure_tensor_swapping", "set on the bnb optimizer's "
             "swapper only: it sees no state tensors", ("self", "parameter")),
    Override(ZERO3, "_swappable_optimizer_subgroup", CALL, CALL_SCOPE, "", "whether DeepSpeed swaps a sub-group to "
             "NVMe (its fp32 partition of 1 MiB or more)", ("self", "sub_group_id")),
    _subclass(ZERO3, NVME_PY, "_optimizer_states_and_gradient_swap_in", "DeepSpeed's swap writes report success for "
              "short files (a full disk) and its reader then asserts, aborting one rank: its files are checked first, "
              "a short one recorded and extended, and the ranks agree on it after the step; the swapped-out "
              "partition's placeholder gets the master dtype back (DeepSpeed empties it as fp32, and with bf16 master "
              "weights its buffer pool then asserts at the next swap-in); also called to bring a sub-group in outside "
              "a step (checkpoints, loads)", ("self", "sub_group_id")),
    _subclass(ZERO3, ZERO3_PY, "step", "with the optimizer on NVMe, the ranks agree on swap failures after the step "
              "and all raise the same error; no sub-group's model copy left pending (lp_copy.py), also when it "
              "raises", ("self",)),
    Override(ZERO3, "_optimizer_states_and_gradient_swap_out", CALL, CALL_SCOPE, "", "and back to NVMe",
             ("self", "sub_group_id")),
    _subclass(ZERO3, ZERO3_PY, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", "the reduce-scatter chunks each "
              "gradient, read from param.grad, by ceil(numel / dp): for the call, marked parameters' gradients are "
              "shown padded to their partitions (param.grad.data)",
              ("self", "params_to_reduce"), params_since={"communication_data_type": "0.17.2"}),
    _subclass(ZERO3, ZERO3_PY, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads", "reduce_scatter: "
              "false all-reduces a bucket and cuts each gradient at rank * ceil(numel / dp), sizes read from "
              "param.grad: the bucket is laid out with marked parameters' gradients padded to their partitions, "
              "shown as their gradients for the call",
              ("self", "buffer_to_reduce"), params_since={"communication_data_type": "0.17.2"}),
    _subclass(ZERO3, ZERO3_PY, "unscale_and_clip_grads", "owned: the sub-group's combined unscale/clip factor "
              "(unscale_factor.combined_unscale_factor, ZeRO-3's formula: no invalid-norm clause, since its step "
              "returns before it for an invalid norm) is folded into the partition's step instead of a separate pass "
              "over the gradient; tests/unit/test_stage3_unscale.py holds it equal to DeepSpeed's own method",
              ("self", "sub_group_id", "total_norm")),
    _subclass(ZERO3, ZERO3_PY, "_optimizer_step", "the same segment-by-segment step as stages 1/2; on the CPU (on a "
              "GPU where asked for) the kernel writes the model's copy of the updated weights "
              "(runtime/zero/lp_copy.py)",
              ("self", "sub_group_id")),
    _subclass(ZERO3, ZERO3_PY, "_reassign_or_swap_out_partitioned_parameters", "DeepSpeed copies each updated fp32 "
              "sub-group into the model's partition here, then re-points the parameters: where the kernel has just "
              "written that copy, only the re-pointing runs; else DeepSpeed's own (also called after a load: the "
              "low-precision slices follow the loaded master weights)",
              ("self", "sub_group_id")),
    Override(ZERO3, "fp32_partitioned_groups_flat", CALL, OBJECT_SCOPE, "", "each sub-group's fp32 master partition "
             "(read)"),
    _subclass(ZERO3, ZERO3_PY, "_unflatten_partitioned_parameters", "DeepSpeed's step re-points every parameter "
              "partition of each sub-group at its flat buffer: skipped where the buffer and every partition it "
              "assigns still look as its last call left them (runtime/zero/param_views.py), else DeepSpeed's own",
              ("self", "sub_group_id")),
    Override(ZERO3, "fp16_partitioned_groups_flat", CALL, OBJECT_SCOPE, "", "each sub-group's flat buffer of "
             "parameter partitions (read: whether DeepSpeed's re-pointing would change anything; the model's copy "
             "the fused kernel writes)"),
    Override(ZERO3, "fp16_partitioned_groups", CALL, OBJECT_SCOPE, "", "each sub-group's parameter partitions "
             "(read: the tensors DeepSpeed's re-pointing assigns)"),
    _subclass(ZERO3, ZERO3_PY, "get_full_hp_param", "state keys answered from bnb state, dequantized; weights fp32 "
              "(compensated ones joined with their error terms)", ("self", "param", "optim_state_key")),
    _subclass(ZERO3, ZERO3_PY, "set_full_hp_param", "state keys written into bnb state, requantized; compensated "
              "weights split into bf16 and error term", ("self", "value", "param", "optim_state_key")),
    _subclass(ZERO3, ZERO3_PY, "get_local_fp32_param", "state keys answered from bnb state, dequantized; weights as "
              "get_full_hp_param", ("self", "param", "optim_state_key")),
    _subclass(ZERO3, ZERO3_PY, "set_local_hp_param", "state keys written into bnb state, requantized; weights as "
              "set_full_hp_param", ("self", "value", "param", "optim_state_key")),
    Override(ZERO3, "grad_position", CALL, OBJECT_SCOPE, "", "where each parameter's slice lies in its sub-group's "
             "master partition (for the error terms of compensated master weights)"),
    Override(ZERO3, "get_param_id", CALL, CALL_SCOPE, "", "a parameter's key in grad_position", ("self", "param")),
    Override(ZERO3, "_get_param_partition_group", CALL, CALL_SCOPE, "", "the group a parameter's slices are "
             "gathered over (before it, the DP group)", ("self", "param"), since="0.19.3"),
    Override(ZERO3, "_get_param_partition_rank", CALL, CALL_SCOPE, "", "this rank's slice of a parameter (before "
             "it, the rank in the DP group)", ("self", "param"), since="0.19.3"),
    _subclass(ZERO3, ZERO3_PY, "_get_fp32_opt_state_partition", "refuses state keys (bnb state is not one fp32 "
              "value per element)", ("self", "param", "optim_state_key"),
              params_since={"release_swap_buffers": "0.16.9"}),
    _subclass(ZERO3, ZERO3_PY, "state_dict", "the per-rank record, plus fp32_flat_groups in stock slices for "
              "zero_to_fp32", ("self",)),
    _subclass(ZERO3, ZERO3_PY, "load_state_dict", "refused: loading goes through engine.load_checkpoint",
              ("self", "state_dict_list")),
    Override(ZERO3, "_rigid_state_dict", CALL, CALL_SCOPE, "", "DeepSpeed's own entries of the stage-3 state",
             ("self",)),
    Override(ZERO3, "_load_global_state_stage3", CALL, CALL_SCOPE, "", "loss scaler and clip from a rank's state",
             ("self", "sd")),
    Override(ZERO3, "_get_sub_group_process_group", CALL, CALL_SCOPE, "", "a sub-group's partition group (before "
             "it, every sub-group is partitioned over the DP group)", ("self", "sub_group_id"), since="0.19.3"),
    Override(ZERO3, "param_names", CALL, OBJECT_SCOPE, "", "names of the parameters (before it, built from the "
             "module)", since="0.18.0"),
    # ---- ZeRO-3 parameter partitions --------------------------------------------------------------------------
    Override(f"{PARTITION}.Init", "_padding_size", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.partition_parameters:_padding_size", "pads marked parameters to a multiple "
             "of 256 * world instead of world", ("self", "param")),
    Override(f"{PARTITION}.Init", "_allgather_params_coalesced", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.partition_parameters:_allgather_params_coalesced", "before 0.19.8 it waits on "
             "the last of its asynchronous all-gathers only, which races on gloo: there each is made to finish "
             "(every engine while deepspeed_bnb is active; 0.19.8 waits on every handle itself)",
             ("self", "param_list", "hierarchy", "quantize")),
    Override(PARTITION, "dist", SWAP, CALL_SCOPE, "deepspeed_bnb.runtime.zero.partition_parameters:_FinishedGathers",
             "deepspeed.comm as partition_parameters calls it, with all-gathers that finish before they return, "
             "during Init._allgather_params_coalesced (releases before 0.19.8, gloo)"),
    Override(f"{PARTITION}.Init", "_partition_world_size", CALL, CALL_SCOPE, "", "the partition world size of a "
             "parameter (before it, Init.num_partitions)", ("self", "param"), since="0.19.3"),
    Override(PARTITION, "_dist_allgather_fn", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.partition_parameters:_dist_allgather_fn", "_all_gather_sequential sizes "
             "its buffer as ceil(numel / world) * world, shorter than a block-aligned partition",
             ("input_tensor", "output_tensor", "group")),
    Override(f"{PARTITION}.NoGatherHandle", "__init__", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.partition_parameters:_no_gather_init", "on one rank the whole partition is "
             "viewed as the parameter: handed the partition without its padding", ("self", "param")),
    Override(f"{PARTITION}.NoGatherCoalescedHandle", "__init__", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.runtime.zero.partition_parameters:_no_gather_coalesced_init", "as NoGatherHandle",
             ("self", "params")),
    # ---- DeepSpeed's parameter-level optimizer-state API ----------------------------------------------------------
    Override(FRAGMENT, "safe_get_local_optimizer_state", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:safe_get_local_optimizer_state", "stage 3 only upstream; answered "
             "for ZeRO-1/2 bnb parameters from bnb state", ("param", "optim_state_key")),
    Override(FRAGMENT, "safe_set_local_optimizer_state", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:safe_set_local_optimizer_state", "as safe_get_local_optimizer_state",
             ("param", "value", "optim_state_key")),
    Override("deepspeed.utils", "safe_get_local_optimizer_state", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:safe_get_local_optimizer_state", "the re-export users import",
             ("param", "optim_state_key")),
    Override("deepspeed.utils", "safe_set_local_optimizer_state", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:safe_set_local_optimizer_state", "the re-export users import",
             ("param", "value", "optim_state_key")),
    Override(f"{FRAGMENT}.tensor_fragment", "__init__", OBJECT, OBJECT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:BnbTensorFragment", "a linked parameter's _hp_mapping becomes a "
             "subclass that answers state keys from bnb state (built from the dataclass fields)"),
    Override(FRAGMENT, "get_full_hp_param", OBJECT, OBJECT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:get_full_hp_param", "rebound on each linked parameter, as "
             "DeepSpeed's link does; weights still DeepSpeed's", ("self", "optim_state_key")),
    Override(FRAGMENT, "set_full_hp_param", OBJECT, OBJECT_SCOPE,
             "deepspeed_bnb.utils.tensor_fragment:set_full_hp_param", "as get_full_hp_param",
             ("self", "value", "optim_state_key")),
    # ---- DeepSpeed's universal-checkpoint converter ---------------------------------------------------------------
    Override("deepspeed.checkpoint.ds_to_universal", "main", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.checkpoint.ds_to_universal:main", "reads every optimizer state as torch Adam's exp_avg / "
             "exp_avg_sq fragments (KeyError 'exp_avg' on bnb state): a deepspeed_bnb checkpoint is written as the "
             "8-bit universal checkpoint instead, any other goes to DeepSpeed's converter", ("args",)),
    # ---- Accelerate -----------------------------------------------------------------------------------------------
    Override("accelerate.accelerator.Accelerator", "_prepare_deepspeed", REPLACE, IMPORT_SCOPE,
             "deepspeed_bnb.integrations.accelerate:_prepare_deepspeed", "under optimizer offload Accelerate replaces "
             "any client optimizer with DeepSpeedCPUAdam unless zero_force_ds_cpu_optimizer is false",
             ("self",), trigger="accelerate.accelerator"),
)

BY_KEY: Dict[str, Override] = {o.key: o for o in OVERRIDES}
if len(BY_KEY) != len(OVERRIDES):
    raise RuntimeError("deepspeed_bnb: two override entries share a key")


def resolve(path: str):
    """The object at a dotted path "package.module.Class.attr" (the longest importable module prefix, then
    attributes), or "module:qualname"."""
    if ":" in path:
        module, qualname = path.split(":", 1)
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"deepspeed_bnb: cannot resolve {path}")


def parameters(func) -> Tuple[str, ...]:
    """A callable's parameter names, in order; through a decorator's (*args, **kwargs) wrapper that keeps the function
    it wraps in its closure (DeepSpeed's `instrument_w_nvtx` does not use functools.wraps)."""
    names = tuple(inspect.signature(func).parameters)
    if names == ("args", "kwargs"):
        inner = [c.cell_contents for c in getattr(func, "__closure__", None) or () if callable(c.cell_contents)]
        if len(inner) == 1:
            return parameters(inner[0])
    return names


def _releases(entry: Override) -> str:
    first = max(Version(entry.since), Version(CHECKED[0])) if entry.since else Version(CHECKED[0])
    text = f"{first}-{CHECKED[1]}"
    if entry.params_since:
        text += "; " + ", ".join(f"`{p}` from {v}" for p, v in entry.params_since.items())
    return text


def table() -> str:
    """The register as a markdown table (docs/overrides.md lists every override with it)."""
    rows = ["| DeepSpeed / Accelerate symbol | what deepspeed_bnb does | scope | ours | why | releases |",
            "|---|---|---|---|---|---|"]
    for o in OVERRIDES:
        ours = f"`{o.replacement.split(':', 1)[1]}` ({o.replacement.split(':')[0].replace('deepspeed_bnb.', '')})" \
            if o.replacement else ""
        rows.append(f"| `{o.owner}.{o.name}` | {o.how} | {o.scope} | {ours} | {o.why} | {_releases(o)} |")
    return "\n".join(rows)
