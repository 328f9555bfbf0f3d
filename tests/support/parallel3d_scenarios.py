"""Tensor and pipeline parallelism together (run by distributed_scenarios.py): a Megatron-style 3D run, tensor-parallel
2 x 2 pipeline stages x data-parallel 1 on 4 ranks under ZeRO-1, saved, exported as one 8-bit universal checkpoint and
loaded at other layouts: the whole model at data-parallel 1 and 2, tensor-parallel 2 without a pipeline, and 2 stages
without tensor parallelism (each at data-parallel 1), so the tensor-parallel size, the pipeline size and the
data-parallel size change together.

The model is parallel_scenarios.py's pipeline (embedding, two MLP blocks, head) with its blocks cut the way Megatron-LM
cuts an MLP (tests/support/megatron_tp.py). The widths make both kinds of cut occur: the first block's column-parallel
slices are whole quantization blocks (64 x 40 elements = 10 blocks), the second's are not (19 x 40), and row-parallel
weights are cut along dim 1, inside blocks; the second block's slices (760 elements) are also under min_8bit_size, so
bnb holds 32-bit state for them on the tensor-parallel ranks and 8-bit state for the whole weight (1,520 elements).
"""

import os

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm as dist

from deepspeed_bnb.runtime.zero.compat import all_gather_object, checkpoint_mp_rank
from support.distributed_scenarios import LOADER_LR, global_state, weights_follow_master
from support.megatron_tp import ParallelMLP, TensorParallel
from support.parallel_scenarios import (Embed, Head, MICRO_STEPS, compare_with_slices, compare_with_whole, folder_of,
                                        pipeline_loss, run_steps, saved_shapes, universal_of)
from support.toy import MIN_8BIT_SIZE, ds_config, freeze

KIND = "tp2pp2_stage1"
SAVED = dict(tp=2, pp=2)  # the saved layout, at data-parallel 1: 4 ranks
SAVED_WORLD = SAVED["tp"] * SAVED["pp"]
LOADS = {1: [(1, 1)], 2: [(1, 1), (2, 1), (1, 2)]}  # loading world size -> its (tensor-parallel, pipeline) layouts
# not trained: the embedding (stage 0, every tensor-parallel rank's whole) and the second block's column-parallel bias
# (stage 1, cut along dim 0), read from the layer files of each tensor-parallel rank (`layer_02-model_<t>-...`)
FROZEN = ("0.emb.weight", "2.fc_bias")


def build(world, tp, pp, seed=0, lr=1e-3, universal=False):
    """The 3D model on `world` ranks: `tp` tensor-parallel ranks x `pp` stages x the rest data-parallel, ZeRO-1."""
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    dp = world // (tp * pp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    parallel = TensorParallel(tp, topology.get_coord(dist.get_rank()).model)
    torch.manual_seed(seed)
    model = PipelineModule([LayerSpec(Embed), LayerSpec(ParallelMLP, 40, 128, parallel),
                            LayerSpec(ParallelMLP, 40, 38, parallel), LayerSpec(Head)],
                           topology=topology, loss_fn=pipeline_loss, partition_method="uniform")
    if tp > 1:  # the grid exists once the module is built: its slice-parallel group is the tensor-parallel one
        parallel.group = model._grid.get_slice_parallel_group()
    trained = freeze(model, FROZEN)
    config = ds_config(dp, stage=1, micro_steps=MICRO_STEPS)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = bnb.optim.AdamW8bit([{"params": trained, "lr": lr}], min_8bit_size=MIN_8BIT_SIZE)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def scenario_parallel3d_save(world, rank, out):
    """3 steps at the saved layout, saved with the state beside it, then 10 more steps (what a resume must track)."""
    folder = folder_of(out, KIND, 1)
    engine = build(world, **SAVED)
    run_steps(engine, range(3), pipeline=True)
    engine.save_checkpoint(folder, tag="t")
    reference = global_state(engine, world)
    if rank == 0:
        torch.save(reference, os.path.join(folder, "reference_state.pt"))
    return {KIND: {"continued": run_steps(engine, range(3, 13), pipeline=True)}}


def export_universal(out):
    """`deepspeed-bnb export --universal` of the saved run (its 4 model-parallel ranks joined), with its report."""
    from deepspeed_bnb.checkpoint.tools.export import export
    written = export(folder_of(out, KIND, 1), universal_of(out, KIND, 1), universal=True, progress=False)
    torch.save({"joined": written.get("joined", "")}, os.path.join(universal_of(out, KIND, 1), "report.pt"))


def universal_whole(path):
    """name -> the universal checkpoint's master weights and state of every parameter (whole), and name -> shape."""
    from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint
    checkpoint, states, shapes = UniversalCheckpoint(path), {}, {}
    for g, group in enumerate(checkpoint.param_shapes()):
        for (name, shape), master, state in zip(group.items(), checkpoint.master_weights(g),
                                               checkpoint.param_states(g)):
            states[name] = {"master": master.reshape(-1), **state.values}
            shapes[name] = tuple(shape)
    return states, shapes


def local_shapes(engine, world):
    """name -> model-parallel rank -> the shape of that rank's parameter, from every rank's module."""
    mine = (checkpoint_mp_rank(engine), {name: tuple(p.shape) for name, p in engine.module.named_parameters()})
    everyone = [None] * world
    all_gather_object(everyone, mine)
    shapes = {}
    for mp, held in everyone:
        for name, shape in held.items():
            shapes.setdefault(name, {})[mp] = shape
    return shapes


def scenario_parallel3d_load(world, rank, out):
    """The universal checkpoint of the 3D run loaded at each of LOADS[world]'s layouts: at model-parallel size 1
    compared with the saved ranks' slices joined (DeepSpeed's own param_shapes of the saved tag locate them), at
    another model-parallel layout with the universal checkpoint's state cut for each rank; the next 10 steps, and a
    fresh-moment resume as the control."""
    folder, universal = folder_of(out, KIND, 1), universal_of(out, KIND, 1)
    reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
    states, whole = universal_whole(universal)
    results = {}
    for tp, pp in LOADS[world]:
        engine = build(world, tp, pp, seed=1, lr=LOADER_LR, universal=True)
        engine.load_checkpoint(universal)
        loaded = global_state(engine, world)
        if tp * pp == 1:
            relation = compare_with_slices(loaded, reference, saved_shapes(folder, SAVED_WORLD), whole)
        else:
            relation = compare_with_whole(loaded, states, local_shapes(engine, world), whole)
        prefix = f"mp{checkpoint_mp_rank(engine)}/" if tp * pp > 1 else ""
        follows = weights_follow_master(engine, loaded, prefix=prefix)
        lr = [g["lr"] for g in engine.optimizer.param_groups]
        continued = run_steps(engine, range(3, 13), pipeline=True)
        control = build(world, tp, pp, seed=1, lr=LOADER_LR, universal=True)
        control.load_checkpoint(universal, load_optimizer_states=False)
        results[f"tp{tp}pp{pp}dp{world // (tp * pp)}"] = {
            **relation, "weights_follow_master": follows, "lr": lr, "continued": continued,
            "state_dropped": run_steps(control, range(3, 13), pipeline=True),
            "report": torch.load(os.path.join(universal, "report.pt"))["joined"]}
    return results
