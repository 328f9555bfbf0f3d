"""`"checkpoint": {"load_universal": true}` for an engine of deepspeed_bnb: a DeepSpeed universal checkpoint loaded at
this engine's DP size and ZeRO stage (the 8-bit kind with every parameter's state bit for bit; torch AdamW's fp32
moments, ours or ds_to_universal's, quantized to the nearest code).

DeepSpeed's own universal loader (`load_hp_checkpoint_state_from_checkpoint_dir`) takes every file of a parameter
folder as an element-wise tensor and cuts it by tensor-parallel rank and by the rank's fragment; 8-bit codes, block
scales and maps cannot be cut that way, and bnb partitions are not DeepSpeed's fragments. So the publishing rank writes
the checkpoint once as a deepspeed_bnb tag of one rank (`convert`, into a scratch folder beside it), and every rank
loads that through the ordinary route (manifest, safe loader, block-aligned resharding to any DP size and stage;
converted_load.py). A tensor- or pipeline-parallel engine gets one tag of its own layout: every rank's parameters
(its stage's, each sliced for its tensor-parallel rank: checkpoint/tools/universal_split.py), gathered from the ranks
first. The scratch folder is removed afterwards, whatever happens.
"""

import contextlib
import dataclasses
import os

from deepspeed import comm as dist

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import LATEST_UNIVERSAL, read_pointer, safe_name
from deepspeed_bnb.checkpoint.tools.convert import convert
from deepspeed_bnb.checkpoint.tools.universal_split import convert_for_model_parallel, rank_layouts
from deepspeed_bnb.runtime.converted_load import load_through_scratch
from deepspeed_bnb.runtime.zero import compat

SCRATCH = ".{tag}.from-universal"  # + the load's token + converted_load.SCRATCH_SUFFIX: beside the tag


def _model_parallel_layouts(engine):
    """Every model-parallel rank's layout (checkpoint/tools/universal_split.py) where `engine` is tensor- or
    pipeline-parallel, gathered from all ranks (each knows its own parameters' slices, frozen ones included, its
    buffers and its parameters' state precision); None otherwise."""
    place = engine.optimizer.bnb_model_parallel
    if place.size == 1:
        return None
    shapes = [{name: tuple(shape) for name, shape in group.items()} for group in engine._get_zero_param_shapes()]
    frozen = {name: tuple(param.shape) for name, param in engine.module.named_parameters() if not param.requires_grad}
    persistent = engine.module.state_dict().keys()
    buffers = [name for name, _ in engine.module.named_buffers() if name in persistent]
    held = [None] * dist.get_world_size()
    compat.all_gather_object(held, (compat.checkpoint_mp_rank(engine), place, shapes, frozen, buffers,
                                    engine.optimizer.bnb.eight_bit_by_name()))
    by_rank = {mp_rank: rest for mp_rank, *rest in held}
    layouts = rank_layouts([by_rank[r][:4] for r in range(len(by_rank))])
    return [dataclasses.replace(layout, eight_bit=by_rank[r][4]) for r, layout in enumerate(layouts)]


def load_universal(engine, load_dir: str, tag, arguments: dict, agree, publisher: bool):
    """Load the universal checkpoint `load_dir`/`tag` (None: the one latest_universal names) into `engine`, a bnb
    ZeRO engine; `arguments`: load_checkpoint's other arguments; `agree`: checkpointing.agree (one outcome on every
    rank); `publisher`: whether this rank writes. Returns what load_checkpoint returns."""
    what = f"load_checkpoint({load_dir!r}, tag={tag!r}) with checkpoint.load_universal failed: "
    if tag is None:
        tag = read_pointer(load_dir, LATEST_UNIVERSAL)
        if tag is None:
            raise CheckpointMismatchError(f"{what}{os.path.join(load_dir, LATEST_UNIVERSAL)} does not exist: pass "
                                          f"the tag, or the directory DeepSpeed's ds_to_universal (or `deepspeed-bnb "
                                          f"export --universal`) wrote.")
        agree(lambda: safe_name(tag, os.path.join(load_dir, LATEST_UNIVERSAL), "tag", one_component=True),
              context=what)
    tag = str(tag)
    bnb_optimizer = engine.optimizer.optimizer
    stage = engine.zero_optimization_stage()
    layouts = _model_parallel_layouts(engine)  # None for a data-parallel engine
    source, cls, size = os.path.join(load_dir, tag), type(bnb_optimizer), bnb_optimizer.args.min_8bit_size

    def write(scratch):
        if layouts is not None:
            return convert_for_model_parallel(source, scratch, layouts, cls, size, stage)
        return convert(source, scratch, "8bit", optimizer_class=cls, min_8bit_size=size, progress=False, dp=1,
                       stage=stage, eight_bit_by_name=engine.optimizer.bnb.eight_bit_by_name())

    @contextlib.contextmanager
    def as_our_tag():  # the scratch tag is a deepspeed_bnb one, not universal
        engine._config.load_universal_checkpoint = False
        try:
            yield
        finally:
            engine._config.load_universal_checkpoint = True

    return load_through_scratch(engine, load_dir, tag, SCRATCH.format(tag=tag), write, arguments, agree, publisher,
                                what, "universal checkpoint",
                                f"deepspeed-bnb convert {source} OUT --to 8bit --optimizer-class ...", as_our_tag)
