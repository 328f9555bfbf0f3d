"""What BnbZeroOptimizer needs from DeepSpeed's ZeRO-1/2 optimizer that not every DeepSpeed release has.

DeepSpeed 0.19.7 added per-parameter padding inside ZeRO-1/2 flat groups (`zero_optimization.parameter_alignment`):
`flatten_dense_tensors_aligned(..., param_padding=...)`, the `round_robin_bit16_padding` / `round_robin_bit16_offsets`
lists, and their use in gradient partitioning, offload, the links to the fp32 partition and checkpoints. On those
releases the block-aligned layout of bitsandbytes state is chosen through exactly that padding ("param_padding");
on earlier ones it is made of zero padding tensors placed between the parameters in DeepSpeed's own lists
("tensors", runtime/zero/padding_tensors.py). Both give the same flat buffers and the same checkpoint files.
DEEPSPEED_BNB_ZERO_PADDING=tensors selects the second on any release (to compare the two in one run).

Between the supported releases (each difference a symbol of the override register, overrides.py, with the
release that added it; the functions below read them):
- DeepSpeed 0.19.8 copies gradients into the ZeRO-Offload CPU buffers asynchronously and waits for those copies
  before loading a checkpoint (`_wait_for_offload_copies`); earlier releases copy synchronously.
- DeepSpeed before 0.19.8 does not average gradients across ranks under ZeRO-1 with a separate fp32 gradient
  accumulator (`use_grad_accum_attribute`: bf16/fp16 with data_types.grad_accum_dtype "fp32", a combination
  deepspeed_bnb routes to DeepSpeedZeroOptimizer): `get_gradient_for_reduction` returns
  `param.grad_accum.to(self.dtype)`, a copy, so the reduced values land in the copy and the step reads the rank's own
  `grad_accum`. 0.19.8 reduces `grad_accum` itself. Stock DeepSpeedZeroOptimizer with torch.optim.AdamW shows the same
  divergence at DP=2, so it is refused here.
- DeepSpeed 0.19.8 clips the ZeRO-1/2 gradient with an infinite norm where the norm is invalid (inf, NaN or its -1
  sentinel: the gradient is zeroed); earlier releases clamp what the formula gives (-1: no clipping, NaN: NaN).
  0.19.7 skips unscale_and_clip_grads when there is neither clipping nor a loss scale (earlier releases multiply by
  1.0). deepspeed_bnb computes that factor itself (unscale_factor.combined_unscale_factor), per release.
- DeepSpeed before 0.19.8 waits on the last of the asynchronous all-gathers of a coalesced ZeRO-3 gather only,
  which races on gloo (a wrapper waits on each: runtime/zero/partition_parameters.py).
- DeepSpeed 0.18.7-0.18.9 flatten each ZeRO-1/2 group from the parameters themselves wherever the accelerator
  reports room for it (the CPU accelerator always does), with autograd recording: the flat buffer is then the result
  of a `cat` that requires grad, and the all-gather of updated weights into it after each step fails on gloo ("Output
  0 of Split is a view and is being modified inplace"; stock DeepSpeedZeroOptimizer with torch.optim.AdamW fails the
  same way at DP=2). 0.19.0 went back to flattening copies. BnbZeroOptimizer flattens its groups without autograd on
  every release, which gives the leaf buffer the other releases have.
- DeepSpeed 0.18.3 added bf16 master weights (`bf16.bf16_master_weights_and_grads`, the ZeRO optimizers' keyword
  `bf16_master_weights_and_gradients` and `ZeROOptimizer._configure_master_weights`, whose bf16 check is the
  keyword `bf16_fp32_offload_validator` until 0.19.0 and `bf16_offload_validator` from 0.19.1); earlier releases
  cannot keep bf16 master weights, so deepspeed_bnb's bf16 modes are refused there.
- Smaller additions, each with a fallback below: the checkpoint engine's `is_decoupled` (0.17.1), `all_gather_object`
  in deepspeed.comm (0.17.0), the ZeRO optimizers' `torch_autocast_gradscaler` (0.17.2), SuperOffload (0.18.0),
  ZeRO-3's `param_names` (0.18.0), per-sub-group and per-parameter partition groups and `param_shapes` in MoE model
  states (0.19.3), the engine's `checkpoint_mp_rank` (0.19.6).
"""

import functools
import inspect
import os

import deepspeed
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from packaging.version import Version

PARAMETER_PADDING_SINCE = "0.19.7"
PADDING_ENV = "DEEPSPEED_BNB_ZERO_PADDING"
PARAM_PADDING, PADDING_TENSORS = "param_padding", "tensors"  # how the block-aligned ZeRO-1/2 layout is placed


@functools.lru_cache(maxsize=None)
def _release_at_least(deepspeed_version: str, first: str) -> bool:
    """Whether DeepSpeed release `deepspeed_version` (pre-releases as their release) is `first` or later; memoized:
    some of the predicates below are asked on every optimizer step, and parsing versions costs more than the rest."""
    return Version(Version(deepspeed_version).base_version) >= Version(first)


def by_name(deepspeed_init, args: tuple, kwargs: dict) -> dict:
    """The arguments DeepSpeed's engine passed to its ZeRO optimizer, every one by its parameter name in this
    release's own `__init__` signature. Releases insert parameters in the middle (`gradient_average`, before
    `gradient_accumulation_steps`): a subclass that read or passed positions would hand each later value to the wrong
    parameter, silently; bound by name, nothing shifts, and a subclass reads one setting whether it came by position
    or by keyword."""
    signature = inspect.signature(deepspeed_init)
    # bind_partial: a missing argument is left for DeepSpeed's own __init__ to name; None: the unbound `self`
    bound = signature.bind_partial(None, *args, **kwargs).arguments
    named = {}
    for name, value in list(bound.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            raise TypeError(f"deepspeed_bnb: {deepspeed_init.__qualname__} takes *{name}: its arguments cannot be "
                            f"passed on by name")
        named.update(value if kind is inspect.Parameter.VAR_KEYWORD else {name: value})
    return named


def has_parameter_padding(zero_optimizer_class=DeepSpeedZeroOptimizer) -> bool:
    return "param_padding" in inspect.signature(zero_optimizer_class.flatten_dense_tensors_aligned).parameters


def padding_mode(zero_optimizer_class=DeepSpeedZeroOptimizer) -> str:
    """PARAM_PADDING where DeepSpeed has per-parameter padding, else PADDING_TENSORS; DEEPSPEED_BNB_ZERO_PADDING
    picks one explicitly (and is refused where it names what this release lacks)."""
    native = has_parameter_padding(zero_optimizer_class)
    wanted = os.environ.get(PADDING_ENV, "")
    if wanted == "":
        return PARAM_PADDING if native else PADDING_TENSORS
    if wanted not in (PARAM_PADDING, PADDING_TENSORS):
        raise ValueError(f"deepspeed_bnb: {PADDING_ENV}={wanted!r}: use {PARAM_PADDING!r} or {PADDING_TENSORS!r}, "
                         f"or leave it unset (the best this DeepSpeed release has).")
    if wanted == PARAM_PADDING and not native:
        raise ValueError(f"deepspeed_bnb: {PADDING_ENV}={wanted!r}, but DeepSpeed {deepspeed.__version__} has no "
                         f"per-parameter padding in ZeRO-1/2 flat groups (added in {PARAMETER_PADDING_SINCE}); "
                         f"unset it to use padding tensors.")
    return wanted


BF16_MASTER_SINCE = "0.18.3"
BF16_MASTER_VALIDATORS = ("bf16_fp32_offload_validator", "bf16_offload_validator")  # 0.18.3-0.19.0, 0.19.1 on


def has_bf16_master(zero_optimizer_class=DeepSpeedZeroOptimizer) -> bool:
    """Whether this DeepSpeed release's ZeRO optimizer can keep bf16 master weights (0.18.3 on)."""
    return "bf16_master_weights_and_gradients" in inspect.signature(zero_optimizer_class.__init__).parameters


def require_bf16_master(zero_optimizer_class, setting: str) -> None:
    """Refuse bf16 master weights where this DeepSpeed release's ZeRO optimizer cannot keep them (before 0.18.3)."""
    if not has_bf16_master(zero_optimizer_class):
        raise NotImplementedError(
            f"deepspeed_bnb: zero_optimization.bnb_master_weights {setting!r} keeps bf16 master weights, which "
            f"DeepSpeed {deepspeed.__version__} cannot (bf16 master weights came with DeepSpeed {BF16_MASTER_SINCE}). "
            f"Install DeepSpeed >= {BF16_MASTER_SINCE}, or use \"fp32\".")


def flattens_with_autograd(zero_optimizer_class=DeepSpeedZeroOptimizer) -> bool:
    """Whether this release's ZeRO-1/2 __init__ may flatten the parameters themselves (0.18.7-0.18.9; see above)."""
    try:
        return "flatten_on_gpu" in inspect.getsource(zero_optimizer_class.__init__)
    except (OSError, TypeError):  # no source installed: assume it may (flattening without autograd is harmless)
        return True


def wait_for_offload_copies(zero_optimizer) -> None:
    """Let pending gradient copies to the offload buffers finish before a load overwrites state (0.19.8 and later)."""
    wait = getattr(zero_optimizer, "_wait_for_offload_copies", None)
    if wait is not None:  # DeepSpeed 0.19.7 has no asynchronous copies to wait for
        wait()


def reduces_grad_accum(deepspeed_version: str = deepspeed.__version__) -> bool:
    """Whether DeepSpeed averages a separate fp32 gradient accumulator across ranks (0.19.8 on; see above)."""
    return _release_at_least(deepspeed_version, "0.19.8")


def require_reduced_grad_accum(use_grad_accum_attribute: bool, dp_world_size: int,
                               deepspeed_version: str = deepspeed.__version__) -> None:
    """Refuse ZeRO-1 with a separate fp32 gradient accumulator on more than one rank where DeepSpeed would not
    average it (releases before 0.19.8, see the module docstring); one rank has nothing to average."""
    if use_grad_accum_attribute and dp_world_size > 1 and not reduces_grad_accum(deepspeed_version):
        raise NotImplementedError(
            f"deepspeed_bnb: DeepSpeed {deepspeed_version} does not average gradients across data-parallel ranks "
            f"under ZeRO stage 1 with fp32 gradient accumulation (data_types.grad_accum_dtype \"fp32\" with bf16 or "
            f"fp16): it reduces a copy of each accumulated gradient and steps with the unreduced one (fixed in "
            f"DeepSpeed 0.19.8). Install DeepSpeed 0.19.8, or use zero_optimization.stage 2, or drop "
            f"data_types.grad_accum_dtype.")


def clips_invalid_norm_as_inf(deepspeed_version: str = deepspeed.__version__) -> bool:
    """Whether ZeRO-1/2's unscale_and_clip_grads clips an invalid gradient norm as an infinite one (0.19.8)."""
    return _release_at_least(deepspeed_version, "0.19.8")


def waits_every_gather_handle(deepspeed_version: str = deepspeed.__version__) -> bool:
    """Whether ZeRO-3's coalesced all-gather of several parameters waits on each of its asynchronous all-gathers
    (0.19.8 on; before, only on the last: racy on gloo, runtime/zero/partition_parameters.py)."""
    return _release_at_least(deepspeed_version, "0.19.8")


def partitions_empty_secondary_chunks(deepspeed_version: str = deepspeed.__version__) -> bool:
    """Whether ZeRO-3's hpZ partitioning (`Init._partition_param_sec`) copies nothing into a rank's secondary chunk
    that lies wholly in a parameter's padding (0.19.5 on; before, it calls narrow() at a start past the parameter's
    end: IndexError). Stock padding never makes such a chunk; the block-aligned padding of bnb parameters does."""
    return _release_at_least(deepspeed_version, "0.19.5")


def is_decoupled(checkpoint_engine) -> bool:
    """Whether DeepSpeed's checkpoint engine writes files after save returns (none could before 0.17.1)."""
    return getattr(checkpoint_engine, "is_decoupled", lambda: False)()


def super_offload(engine) -> bool:
    """Whether the engine runs SuperOffload (added in DeepSpeed 0.18.0)."""
    return getattr(engine, "super_offload", lambda: False)()


def import_superoffload() -> None:
    """DeepSpeed's SuperOffload stage-3 class (0.18.0 on) subclasses the stage-3 optimizer when its module is first
    imported, inside _configure_zero_optimizer: import it before the stage-3 name is swapped for deepspeed_bnb's."""
    try:
        import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401
    except ImportError:  # DeepSpeed < 0.18.0
        pass


def autocast_gradscaler(zero_optimizer):
    """DeepSpeed's torch-autocast GradScaler of a ZeRO optimizer (attribute added in 0.17.2), or None."""
    return getattr(zero_optimizer, "torch_autocast_gradscaler", None)


def sub_group_process_group(zero3, sub_group_id):
    """The process group a ZeRO-3 sub-group is partitioned over (DeepSpeed 0.19.3 added per-sub-group groups for
    expert parameters; before, every sub-group is partitioned over the data-parallel group)."""
    get = getattr(zero3, "_get_sub_group_process_group", None)
    return get(sub_group_id) if get is not None else zero3.dp_process_group


def param_partition_group(zero3, param):
    """The process group a ZeRO-3 parameter's slices are spread over (DeepSpeed 0.19.3 added per-parameter groups for
    expert parameters; before, the data-parallel group)."""
    get = getattr(zero3, "_get_param_partition_group", None)
    return get(param) if get is not None else zero3.dp_process_group


def param_partition_rank(zero3, param) -> int:
    """This rank's slice of a ZeRO-3 parameter, in param_partition_group's order."""
    get = getattr(zero3, "_get_param_partition_rank", None)
    if get is not None:
        return get(param)
    from deepspeed import comm as dist
    return dist.get_rank(group=zero3.dp_process_group)


def ipg_bucket_params(zero3, communication_data_type=None) -> list:
    """The parameters of the ZeRO-3 gradient bucket being reduced, in the order of its buffer: DeepSpeed 0.17.2 keeps
    one bucket per communication dtype, earlier releases one list."""
    if communication_data_type is None:
        return zero3.params_in_ipg_bucket
    return zero3.ipg_buckets[communication_data_type].params


def name_stage3_params(zero3, module) -> None:
    """`param_names` of a ZeRO-3 optimizer, which DeepSpeed keeps from 0.18.0 on (the engine's names: the
    module's named parameters)."""
    if getattr(zero3, "param_names", None) is None:
        zero3.param_names = {param: name for name, param in module.named_parameters()}


def all_gather_object(object_list: list, obj, group=None) -> None:
    """deepspeed.comm.all_gather_object (DeepSpeed 0.17.0 on); before, torch.distributed's, which DeepSpeed's torch
    backend wraps the same way."""
    from deepspeed import comm as dist
    gather = getattr(dist, "all_gather_object", None)
    if gather is None:
        import torch.distributed
        gather = torch.distributed.all_gather_object
    gather(object_list, obj, group=group)


def with_moe_param_shapes(engine, save):
    """`save` (a checkpoint engine's), adding `param_shapes` to an MoE model's model states where DeepSpeed did not:
    before 0.19.3 its `_save_moe_checkpoint` builds that dict by hand without them, and the reader needs every
    parameter's shape to reshard or export. The same value `_save_checkpoint` writes (`_get_zero_param_shapes`)."""
    def save_with_shapes(state_dict, path, *args, **kwargs):
        if getattr(engine, "has_moe_layers", False) and isinstance(state_dict, dict) and "module" in state_dict \
                and "param_shapes" not in state_dict:
            state_dict = {**state_dict, "param_shapes": engine._get_zero_param_shapes()}
        return save(state_dict, path, *args, **kwargs)
    return save_with_shapes


def checkpoint_mp_rank(engine) -> int:
    """The model-parallel rank in checkpoint file names (DeepSpeedEngine.checkpoint_mp_rank from 0.19.6 on)."""
    rank = getattr(engine, "checkpoint_mp_rank", None)
    if rank is None:
        rank = 0 if engine.mpu is None else engine.mpu.get_model_parallel_rank()
    return rank


def optimizer_swap_paths(swap_info) -> list:
    """The files of one sub-group's fp32 partition in DeepSpeed's optimizer swapper: `get_swap_paths()` from 0.17 on,
    a `swap_paths` list before."""
    getter = getattr(swap_info, "get_swap_paths", None)
    return list(getter()) if getter is not None else list(swap_info.swap_paths)
