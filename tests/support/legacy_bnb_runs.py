"""The runs tests/distributed/test_bnb_049.py compares between a venv with bitsandbytes 0.49.x and this one (0.50.2).

Each scenario trains the toy model (tests/support/toy.py) 4 steps at DP=2 under ZeRO-2 and saves (`save`, under torchrun
with 2 ranks), then a fresh one-rank engine loads that checkpoint at DP=1 and trains 3 more steps (`load`). The load
writes, per scenario, every tensor of the optimizer state and the fp32 master weights right after loading and after the
3 steps, the losses of both phases, each parameter's route and the bitsandbytes version, to <out>/results.pt.
A scenario is an optimizer of OPTIMIZERS, optionally with "@stage3" (ZeRO-3 instead) or "@offload" (ZeRO-2 with
offload_optimizer: the CPU partitions a GPU run with bnb 0.49 would have), and a name ending in "+sim049" runs under
tests/legacy_bnb.simulate_049 (0.49's CPU refusal planted into the installed bnb), so that 0.50.2 takes the path 0.49
must take.

`refuse` (one rank) builds and steps the REFUSALS cases and writes what each raised to <out>/refuse.pt.

    torchrun --nproc_per_node 2 tests/support/legacy_bnb_runs.py save OUT SCENARIO...
    python tests/support/legacy_bnb_runs.py load OUT SCENARIO...
    python tests/support/legacy_bnb_runs.py refuse OUT
"""

import contextlib
import os
import sys

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

import bitsandbytes as bnb  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed_bnb  # noqa: E402,F401
from bitsandbytes.optim.optimizer import Optimizer2State  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from deepspeed_bnb.optim import own_update  # noqa: E402
from deepspeed_bnb.utils.teardown import release_shm_buffer  # noqa: E402

from support.legacy_bnb import simulate_049  # noqa: E402
from support.toy import ds_config, global_batch, local_slice, loss_fn, make_model, param_groups  # noqa: E402

SAVE_STEPS, MORE_STEPS = range(4), range(4, 7)
ALL_8BIT, MIXED = 0, 1000  # min_8bit_size: every parameter 8-bit; biases and LayerNorm (< 1000 elements) 32-bit
OPTIMIZERS = {
    # name -> factory(param groups); the groups carry lr and weight decay (toy.param_groups)
    "adamw8bit": lambda g: bnb.optim.AdamW8bit(g, min_8bit_size=ALL_8BIT),
    "lion8bit": lambda g: bnb.optim.Lion8bit(g, min_8bit_size=ALL_8BIT),
    "sgd8bit": lambda g: bnb.optim.SGD8bit(g, lr=1e-3, momentum=0.9, min_8bit_size=ALL_8BIT),
    "adamw8bit_mixed": lambda g: bnb.optim.AdamW8bit(g, min_8bit_size=MIXED),
    "lion8bit_mixed": lambda g: bnb.optim.Lion8bit(g, min_8bit_size=MIXED),
    "sgd8bit_mixed": lambda g: bnb.optim.SGD8bit(g, lr=1e-3, momentum=0.9, min_8bit_size=MIXED),
    "adamw32": lambda g: bnb.optim.AdamW(g),  # 32-bit state everywhere
}
SIMULATED = "+sim049"
# what nothing can step where bnb has no CPU update: name -> (optimizer factory, ZeRO config overrides, checked?)
REFUSALS = {
    "fused_kernel_false": (OPTIMIZERS["adamw8bit"], dict(bnb_fused_kernel=False), True),
    "rmsprop8bit": (lambda g: bnb.optim.RMSprop8bit(g, min_8bit_size=ALL_8BIT), {}, True),
    # bnb's generic 2-state optimizer, 32-bit state, with a trust ratio (the kernel's fp32 path computes none)
    "trust_ratio_32bit": (lambda g: Optimizer2State("adam", g, lr=1e-3, max_unorm=1e-3), {}, True),
    # control: the same as fused_kernel_false without deepspeed_bnb's check (own_update.missing says nothing)
    "unchecked": (OPTIMIZERS["adamw8bit"], dict(bnb_fused_kernel=False), False),
}
VARIANTS = {"": dict(stage=2), "stage3": dict(stage=3), "offload": dict(stage=2, offload=True)}


def engine_of(scenario: str, world: int):
    name, _, variant = scenario.removesuffix(SIMULATED).partition("@")
    model = make_model(0)
    optimizer = OPTIMIZERS[name](param_groups(model))
    return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(world, **VARIANTS[variant]))[0]


def train(engine, steps, world, rank):
    losses = []
    for step in steps:
        tokens, targets = global_batch(step)
        loss = loss_fn(engine, local_slice(tokens, rank, world), local_slice(targets, rank, world))
        engine.backward(loss)
        engine.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def tensors(engine) -> dict:
    """Every optimizer-state tensor and the fp32 master weights of each param group (one rank: the whole state)."""
    out = {}
    opt = engine.optimizer
    for i in range(len(opt.bnb_steps)):
        partition = opt.bnb_partition_tensor(i)
        out[f"group{i}.master"] = partition.detach().clone()
        for key, value in opt.optimizer.state[partition].items():
            out[f"group{i}.{key}"] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def refusals() -> dict:
    """case -> what building the engine and one step raised ("TypeName: message"), or None. One rank."""
    raised = {}
    for case, (factory, zero, checked) in REFUSALS.items():
        real = own_update.missing
        if not checked:
            own_update.missing = lambda device: None
        try:
            model = make_model(0)
            engine = deepspeed.initialize(model=model, optimizer=factory(param_groups(model)),
                                          config=ds_config(1, stage=2, **zero))[0]
            train(engine, range(1), 1, 0)
            raised[case] = None
        except Exception as exc:  # what the user would see
            raised[case] = f"{type(exc).__name__}: {exc}"
        finally:
            own_update.missing = real
    return raised


def run(phase: str, out: str, scenarios) -> None:
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"bnb": bnb.__version__, "scenarios": {}}
    if phase == "refuse":
        results["refusals"] = refusals()
    for scenario in scenarios:
        with simulate_049() if scenario.endswith(SIMULATED) else contextlib.nullcontext():
            engine = engine_of(scenario, world)
            ckpt = os.path.join(out, scenario)
            if phase == "save":
                results["scenarios"][scenario] = {"losses": train(engine, SAVE_STEPS, world, rank)}
                engine.save_checkpoint(ckpt, tag="s4")
            else:
                engine.load_checkpoint(ckpt, tag="s4")
                loaded = tensors(engine)
                results["scenarios"][scenario] = {
                    "loaded": loaded, "losses": train(engine, MORE_STEPS, world, rank), "final": tensors(engine),
                    "routes": {n: r.reason for n, r in engine.optimizer.bnb_routes.items()},
                    "arithmetic": engine.optimizer.bnb_arithmetic}
    if rank == 0:
        torch.save(results, os.path.join(out, f"{phase}.pt"))
    dist.barrier()
    release_shm_buffer(rank)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
