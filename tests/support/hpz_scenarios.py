"""ZeRO++ hierarchical partitioning (hpZ) scenarios, run by distributed_scenarios.py: `hpz_save` at 4 ranks, `hpz_load`
at 2 (in the later launch, once the 4-rank checkpoint exists).

hpz_save: the toy under ZeRO-3 with `zero_hpz_partition_size: 2`, in the train config `fp32_stage3_zero_init_clip`
(zero.Init partitions the parameters before the optimizer re-partitions them block-aligned; persistence threshold 0, so
every parameter is gathered from secondary partitions; several sub-groups; clipping) trains 20 steps, saving after step
3; the losses are compared on the pytest side with that config's DP=1 run, which has no hpZ. The checkpoint is then
loaded by engines with hpZ 1 and hpZ 4 (the secondary partition size changed on resume), built with another seed, which
continue 17 steps: their losses and final state must equal the run that never stopped, bit for bit (hpZ only changes
where parameters are gathered from, never the optimizer's partitions). Control: the same load without optimizer state
diverges. Also recorded: secondary partitions were in use (every rank held some after a forward).
hpz_load: the 4-rank checkpoint loaded at DP 2 with hpZ 2 continues within the bar of the run that never stopped.
"""

import os

import deepspeed.utils.groups as ds_groups
import torch

from support.bnb_state import same_state as same_param_state

STEPS, SAVE_AT = 20, 3
HPZ = 2  # of the saving run
RESUME_HPZ = (1, 4)  # at 4 ranks: no secondary partitions, and one secondary group of all ranks
TAG = "hpz"
REFERENCE = "fp32_stage3_zero_init_clip"  # the train config (at DP=1, without hpZ) these runs are compared with


def config():
    from support.distributed_scenarios import TRAIN_CONFIGS
    return dict(TRAIN_CONFIGS[REFERENCE])


def folder(out):
    return os.path.join(out, "hpz_dp4")


def build_hpz(world, hpz, seed=0):
    """An engine of the toy with this hpZ size. DeepSpeed keeps the hpZ process group in a module global that refuses
    to be set twice ("ZeRO parameter intra parallel group is already initialized"): each engine here gets its own."""
    from support.distributed_scenarios import build
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    return build(world, seed=seed, zero_hpz_partition_size=hpz, **config())


def steps(engine, span, world, rank):
    from support.distributed_scenarios import run_steps
    return run_steps(engine, span, world, rank, config().get("micro_steps", 1))


def secondary_in_use(engine, world, rank) -> bool:
    """Whether, after one forward, some parameter of this rank is partitioned a second time (hpZ's secondary tensor)."""
    from support.toy import global_batch, local_slice, loss_fn
    tokens, targets = global_batch(0)
    with torch.no_grad():
        loss_fn(engine, local_slice(tokens, rank, world), local_slice(targets, rank, world))
    return any(getattr(p, "ds_secondary_tensor", None) is not None for p in engine.module.parameters())


def final_state(engine):
    """This rank's fp32 partitions and their bnb state (for a bit-for-bit comparison)."""
    opt = engine.optimizer
    return [(p.detach().clone(), {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[p].items()})
            for p in opt.fp32_partitioned_groups_flat]


def same_state(a, b) -> bool:
    """Two final_state()s: every partition and its state bit for bit."""
    return len(a) == len(b) and all(torch.equal(pa, pb) and same_param_state(sa, sb)
                                    for (pa, sa), (pb, sb) in zip(a, b))


def scenario_hpz_save(world, rank, out):
    from support.distributed_scenarios import all_ranks
    engine = build_hpz(world, HPZ)
    losses = steps(engine, range(SAVE_AT), world, rank)
    engine.save_checkpoint(folder(out), tag=TAG)
    losses += steps(engine, range(SAVE_AT, STEPS), world, rank)
    reference = final_state(engine)
    result = {"losses": losses, "secondary_in_use": all_ranks(secondary_in_use(build_hpz(world, HPZ), world, rank)),
              "resumed": {}}
    for hpz in RESUME_HPZ:
        fresh = build_hpz(world, hpz, seed=1)
        fresh.load_checkpoint(folder(out), tag=TAG)
        resumed = steps(fresh, range(SAVE_AT, STEPS), world, rank)
        result["resumed"][str(hpz)] = {"losses": resumed, "state_equal": all_ranks(same_state(reference,
                                                                                              final_state(fresh)))}
    control = build_hpz(world, HPZ, seed=1)
    control.load_checkpoint(folder(out), tag=TAG, load_optimizer_states=False)
    result["state_dropped"] = steps(control, range(SAVE_AT, STEPS), world, rank)
    return result


def scenario_hpz_load(world, rank, out):
    if not os.path.isdir(folder(out)):
        return {"skipped": "no 4-rank hpZ checkpoint (DP 4 not run)"}
    engine = build_hpz(world, HPZ, seed=1)
    engine.load_checkpoint(folder(out), tag=TAG)
    return {"losses": steps(engine, range(SAVE_AT, STEPS), world, rank)}
