"""An engine's model-parallel place (checkpoint/format/model_parallel.py): its tensor-parallel rank, its pipeline
stage, and the dimension each parameter is split along across the tensor-parallel ranks, read from the layers.

The split comes from what marks it, in this order: DeepSpeed's AutoTP conversion metadata (0.19.x attaches it to every
parameter of its tensor-parallel layers); AutoTP's two plain layer classes by type where a release attaches no
metadata (LinearLayer cuts its weight and bias along dim 0, LinearAllreduce its weight along dim 1 and keeps its bias
whole); Megatron-style attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`). The layer's type
goes before the attributes because AutoTP's layers before 0.19 mark their weights `tensor_model_parallel` too, without
a `partition_dim`. A parameter of any other module is taken as held whole by every tensor-parallel rank; a reader
checks that their copies agree before it joins the ranks (checkpoint/format/merged.py), so a split nothing marked is
refused rather than joined wrongly.
"""

from typing import Dict

import torch

from deepspeed_bnb.checkpoint.format.model_parallel import ALONE, TIED, ModelParallelPlace, Split


def place_of(engine) -> ModelParallelPlace:
    """The place of this rank of `engine` (built up to its optimizer: AutoTP has already cut the module)."""
    mpu = engine.mpu
    tp_size, tp_rank, pp_size, pp_stage = 1, 0, 1, 0
    if mpu is not None:
        # a PipelineEngine's grid, AutoTP's deepspeed.utils.groups, or the client's (Megatron-style) mpu; a
        # PipelineEngine sets its own num_stages / stage_id only after DeepSpeed has built the optimizer. A grid's
        # "model parallel" is stages x tensor-parallel ranks; its tensor-parallel part is the slice-parallel one
        # (DeepSpeed 0.16.x grids have no get_tensor_model_parallel_* methods, later ones alias them to it)
        size = _first(mpu, "get_slice_parallel_world_size", "get_tensor_model_parallel_world_size",
                      "get_model_parallel_world_size")
        rank = _first(mpu, "get_slice_parallel_rank", "get_tensor_model_parallel_rank", "get_model_parallel_rank")
        tp_size, tp_rank = int(size()), int(rank())
        if hasattr(mpu, "get_pipe_parallel_world_size"):
            pp_size, pp_stage = int(mpu.get_pipe_parallel_world_size()), int(mpu.get_stage_id())
    layers = pipeline_layer_names(engine.module)
    if tp_size == 1 and pp_size == 1 and not layers:
        return ALONE
    splits = tensor_parallel_splits(engine.module) if tp_size > 1 else {}
    return ModelParallelPlace(tp_size, tp_rank, pp_size, pp_stage, splits, layers)


def pipeline_layer_names(module) -> Dict[int, str]:
    """A PipelineModule's layer file index -> the module name of what that file holds (ModelParallelPlace.layers),
    for every stage's layers: DeepSpeed's PipelineModule.save_state_dict writes `layer_<i>` for each layer that has
    a state_dict, i its index in the whole pipeline. _build registers a LayerSpec's or an nn.Module's layer as `<i>`
    and a TiedLayerSpec's module once, as `tied_modules.<key>`, stepping it as a layer (a file) only where the spec
    has no forward_fn (a forward_fn makes the layer a partial: no file). A plain function is no module: no file.
    Empty for any other module."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    if not isinstance(module, PipelineModule):
        return {}
    layers = {}
    for index, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):  # (a LayerSpec too: tested first)
            if spec.forward_fn is None:
                layers[index] = f"{TIED}{spec.key}"
        elif isinstance(spec, (LayerSpec, torch.nn.Module)):
            layers[index] = str(index)
    return layers


def unsaved_tied_tensors(module) -> Dict[str, list]:
    """A PipelineModule's tied modules whose every TiedLayerSpec has a forward_fn -> the names of their tensors that no
    checkpoint file holds: the frozen parameters and persistent buffers. DeepSpeed's save_state_dict writes a layer
    file only for a layer with a state_dict, and _build makes every spec with a forward_fn a partial, so such a module
    is in no layer file; its trained parameters come back from the optimizer's master weights, the rest does not (a
    load keeps the loading engine's values, in stock DeepSpeed as here). Empty for any other module."""
    from deepspeed.pipe import PipelineModule, TiedLayerSpec
    if not isinstance(module, PipelineModule):
        return {}
    saved = {spec.key for spec in module._layer_specs if isinstance(spec, TiedLayerSpec) and spec.forward_fn is None}
    unsaved = {}
    for key, tied in module.tied_modules.items():
        if key in saved:
            continue
        params = dict(tied.named_parameters(remove_duplicate=False))
        names = [name for name in tied.state_dict(keep_vars=True)
                 if name not in params or not params[name].requires_grad]
        if names:
            unsaved[f"{TIED}{key}"] = names
    return unsaved


def _first(mpu, *names):
    """The first of the methods `names` that `mpu` has."""
    return next(getattr(mpu, name) for name in names if hasattr(mpu, name))


def tensor_parallel_splits(module) -> Dict[str, Split]:
    """Parameter name (as the engine names it: the first name of a tied parameter) -> its Split."""
    canonical = {id(param): name for name, param in module.named_parameters()}
    splits: Dict[str, Split] = {}
    for module_name, child in module.named_modules():
        for local, param in child.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if canonical.get(id(param)) == name:
                splits[name] = _split(child, local, param)
    return splits


def _split(layer, local: str, param) -> Split:
    meta = _autotp_meta(param)
    if meta is not None:
        if meta.get("unsupported_reason"):
            return f"AutoTP marks it unsupported: {meta['unsupported_reason']}"
        if meta.get("sub_param_shard_widths") or meta.get("sub_param_shape"):
            return "a fused AutoTP layer (sub-parameters sliced separately): not joined by deepspeed_bnb"
        return None if meta.get("replicated") else meta.get("partition_dim")
    kind = _autotp_layer_kind(layer)
    if kind == "column":
        return 0
    if kind == "row":
        return 1 if local == "weight" else None
    if kind is not None:
        return f"AutoTP layer {type(layer).__name__}: its split is not known to deepspeed_bnb"
    if getattr(param, "tensor_model_parallel", False):  # Megatron-LM's marks
        if getattr(param, "partition_dim", None) is None:
            return "marked tensor_model_parallel without a partition_dim: its split is not known to deepspeed_bnb"
        if getattr(param, "partition_stride", 1) != 1:
            return f"a Megatron strided split (partition_stride {param.partition_stride}): not joined"
        return int(param.partition_dim)
    return None


def _autotp_meta(param):
    """DeepSpeed's conversion-facing AutoTP metadata of `param` (0.19.x), or None."""
    try:
        from deepspeed.module_inject.layers import _get_param_uc_conversion_meta
    except ImportError:
        return None
    return _get_param_uc_conversion_meta(param)


def _autotp_layer_kind(layer):
    """"column" (LinearLayer), "row" (LinearAllreduce), "other" (another AutoTP layer) or None (not AutoTP's)."""
    try:
        from deepspeed.module_inject import layers
    except ImportError:
        return None
    base = getattr(layers, "TensorParallel_Layer", None)
    if type(layer) is getattr(layers, "LinearLayer", None):
        return "column"
    if type(layer) in (getattr(layers, "LinearAllreduce", None), getattr(layers, "LmHeadLinearAllreduce", None)):
        return "row"
    if base is not None and isinstance(layer, base):
        return "other"
    return None
