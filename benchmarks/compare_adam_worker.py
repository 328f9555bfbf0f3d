"""One rank of one compare_adam.py configuration: train the demo GPT under ZeRO-2 or 3, measure, write a JSON result.

Launched by compare_adam.py through torchrun (one job per configuration, so peak RSS is per configuration).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import bitsandbytes as bnb
import deepspeed
import torch
import torch.distributed as tdist

import deepspeed_bnb  # noqa: F401  (routes bnb optimizers to BnbZeroOptimizer; leaves the others to DeepSpeed)
from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
from deepspeed_bnb.demo.text import ByteBatches, stdlib_bytes
from deepspeed_bnb.ops import compensated
from deepspeed_bnb.runtime.zero import lp_copy
from deepspeed_bnb.utils.teardown import finish

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_adam_configs import CONFIGS
from tensor_census import PeakSampler, state_bytes_by_key


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=CONFIGS, required=True)
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    p.add_argument("--ckpt_dir", required=True, help="where the checkpoint is saved and measured")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="micro batch per rank")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup_lr_steps", type=int, default=30)
    p.add_argument("--timing_skip", type=int, default=10, help="first steps left out of the step-time median")
    p.add_argument("--valid_batches", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage")
    p.add_argument("--offload", type=int, choices=(0, 1), default=0, help="1: offload_optimizer to the CPU (host "
                   "memory); DeepSpeed's own Adam is then DeepSpeedCPUAdam")
    p.add_argument("--bf16", type=int, choices=(0, 1), default=0, help="1: a bf16 model (DeepSpeed's bf16 section)")
    p.add_argument("--census_steps", type=int, default=2, help="steps after validation during which the bytes of "
                   "master weights, state and gradients are sampled (tensor_census.PeakSampler)")
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def ds_config(args) -> dict:
    """The same training setup for every optimizer; only the optimizer and its deepspeed_bnb keys differ."""
    zero = {"stage": args.stage}
    if args.config in ("bnb8_fused", "bnb8_fallback", "bnb8_fused_ds_copy"):
        zero["bnb_fused_kernel"] = args.config != "bnb8_fallback"
    if args.config.startswith("bnb8_master"):  # the fused kernels step fp32 master weights: bnb's own update
        zero["bnb_master_weights"] = "bf16" if args.config == "bnb8_master_bf16" else "bf16+8"
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                     "warmup_num_steps": args.warmup_lr_steps}},
        "steps_per_print": 10 ** 9,
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if args.config == "ds_bf16_states":  # DeepSpeed 0.19.8's least-memory setting for its own Adams
        cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep the client optimizers (DeepSpeed would refuse them)
    if args.config == "ds_adamw":
        # DeepSpeed builds its own Adam from this section (FusedAdam, or DeepSpeedCPUAdam under offload).
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1}}
    return cfg


def client_optimizer(args, groups):
    if args.config.startswith("bnb8"):
        return bnb.optim.AdamW8bit(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if args.config in ("torch_adamw", "ds_bf16_states", "torch_adamw_fused"):
        return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                 fused=args.config == "torch_adamw_fused")
    return None


def qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def update_path(engine) -> str:
    """In words, which code updates the weights (read back from the built engine, not from the config)."""
    zero, base = engine.optimizer, engine.optimizer.optimizer
    if hasattr(zero, "bnb_update_summary"):
        return f"deepspeed_bnb: {zero.bnb_update_summary()}"
    if type(base).__name__ == "FusedAdam":
        op = getattr(base, "multi_tensor_adam", None)
        return f"DeepSpeed FusedAdam, op {getattr(op, '__module__', '?')} (built for the CPU accelerator)"
    return f"{type(base).__name__} fp32 update"


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def mean_over_ranks(values) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    tdist.all_reduce(t)
    return (t / tdist.get_world_size()).tolist()


MASTER_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")  # DeepSpeed's fp32 weights: ZeRO-1/2, ZeRO-3


def master_partitions(zero) -> list:
    """This rank's master-weight tensors (ZeRO-1/2 or ZeRO-3 attribute): fp32, or bf16 where the run keeps bf16 master
    weights."""
    return getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat


def master_values(zero) -> list:
    """This rank's master weights as the fp32 values they stand for (compensated ones joined with their error terms:
    the bf16 part alone moves by whole bf16 ulps, which would read as spikes)."""
    errors = getattr(zero, "bnb_master_errors", None) or [None] * len(master_partitions(zero))
    return [t.detach().to(torch.float32, copy=True) if e is None else compensated.join(t.detach(), e)
            for t, e in zip(master_partitions(zero), errors)]


BIG_UPDATE = 10.0  # an element moving more than this many times the lr in one step is counted as a spike


def update_size(masters, before, lr: float):
    """(largest |update| / lr of this rank's master weights in one step, elements beyond BIG_UPDATE * lr); None when
    the lr is 0 (the warm-up's first step). Adam moves an element by about lr at most (|m̂ / sqrt(v̂)| <= ~1)."""
    if lr <= 0:
        return None
    moved = [(t.detach() - b).abs() for t, b in zip(masters, before)]
    return (max(float(m.max()) for m in moved if m.numel()) / lr,
            sum(int((m > BIG_UPDATE * lr).sum()) for m in moved))


def checkpoint_sizes(folder: str) -> dict:
    """Bytes on disk: all files, the *optim_states* files, and inside those the master weights vs the rest."""
    total = optim = master = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            total += size
            if "optim_states" in name:
                optim += size
                saved = torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                key = next(k for k in MASTER_KEYS if k in saved)
                master += sum(t.untyped_storage().nbytes() for t in saved[key])
    return {"ckpt_total": total, "ckpt_optim": optim, "ckpt_optim_master": master}


def main():
    args = parse_args()
    if args.config == "bnb8_fused_ds_copy":  # before the engine is built (runtime/zero/lp_copy.py reads it per step)
        os.environ[lp_copy.ENV] = "0"
    rss_at_start = rss_bytes()  # interpreter + torch + deepspeed + bitsandbytes imported, nothing built
    torch.manual_seed(args.seed)
    cfg = GPTConfig(context=args.context, width=args.width, depth=args.depth, heads=max(1, args.width // 32))
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    groups = decay_groups(model, 0.1)
    phases, clock = {}, time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client_optimizer(args, groups),
                                           model_parameters=groups, config=ds_config(args))
    rank, world = tdist.get_rank(), tdist.get_world_size()
    batches = ByteBatches(stdlib_bytes(), cfg.context)
    generator = torch.Generator().manual_seed(1000 * args.seed + rank)
    phases["init_s"], clock = time.perf_counter() - clock, time.perf_counter()

    losses, step_times, update_times, update_sizes = [], [], [], []
    for _ in range(args.steps):
        x, y = batches.sample("train", args.batch, generator)
        started = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        lr = engine.get_lr()[0]  # the lr this step uses (the scheduler moves it after the step)
        weights = master_values(engine.optimizer)
        before_step = time.perf_counter()
        engine.step()  # ZeRO reduced the gradients during backward; this is clip, update (and ZeRO-2's all-gather)
        done = time.perf_counter()
        step_times.append(done - started)
        update_times.append(done - before_step)
        losses.append(loss.item())
        update_sizes.append(update_size(master_values(engine.optimizer), weights, lr))
    rss_peak_train = rss_bytes()
    phases["train_s"], clock = time.perf_counter() - clock, time.perf_counter()

    engine.eval()
    valid_gen = torch.Generator().manual_seed(10_000 + rank)  # the same held-out windows for every optimizer
    with torch.no_grad():
        valid = sum(engine(*batches.sample("valid", args.batch, valid_gen)).item()
                    for _ in range(args.valid_batches)) / args.valid_batches
    engine.train()
    phases["valid_s"], clock = time.perf_counter() - clock, time.perf_counter()

    # bytes by role (master weights and their error terms, state, gradients at their peak), sampled over a few more
    # steps: the sampler walks every tensor at each gradient hook, too slow for the timed steps above
    sampler = PeakSampler(engine)
    for _ in range(args.census_steps):
        x, y = batches.sample("train", args.batch, generator)
        engine.backward(engine(x, y))
        engine.step()
    sampler.close()
    phases["census_s"], clock = time.perf_counter() - clock, time.perf_counter()

    zero = engine.optimizer
    by_key = state_bytes_by_key(zero.optimizer)
    mine = {
        "state_bytes": sum(by_key.values()),
        "state_bytes_by_key": by_key,
        # what deepspeed_bnb reports about itself, to cross-check the generic walk above
        "bnb_state_bytes": zero.bnb_state_bytes() if hasattr(zero, "bnb_state_bytes") else None,
        "bnb_partition_numel": zero.bnb_partition_numel() if hasattr(zero, "bnb_partition_numel") else None,
        "master_numel": sum(t.numel() for t in master_partitions(zero)),
        "rss_at_start": rss_at_start,
        "rss_peak_train": rss_peak_train,
        "census_peak": sampler.peak,  # role -> the largest bytes seen on this rank (tensor_census.ROLES)
    }
    per_rank = [None] * world
    tdist.all_gather_object(per_rank, mine)
    sizes = [None] * world
    tdist.all_gather_object(sizes, update_sizes)

    engine.save_checkpoint(args.ckpt_dir, tag="final")
    tdist.barrier()
    phases["save_s"] = time.perf_counter() - clock
    if rank == 0:
        skip = min(args.timing_skip, len(step_times) - 1)
        median = statistics.median(step_times[skip:])
        result = {
            "config": args.config,
            "zero_optimizer": qualname(zero),
            "base_optimizer": qualname(zero.optimizer),
            "update_path": update_path(engine),
            "world": world,
            "stage": args.stage,
            "offload": bool(args.offload),
            "bf16": bool(args.bf16),
            "master_weights": getattr(getattr(zero, "bnb_master", None), "mode", None) or str(
                getattr(zero, "master_weights_and_grads_dtype", torch.float32)).replace("torch.", ""),
            "n_params": n_params,
            "model": {"width": args.width, "depth": args.depth, "context": args.context, "vocab": cfg.vocab},
            "steps": args.steps,
            "batch_per_rank": args.batch,
            "timing_skip": skip,
            "median_step_s": median,
            "median_engine_step_s": statistics.median(update_times[skip:]),
            "tokens_per_s": world * args.batch * args.context / median,
            "per_rank": per_rank,
            # per step: the largest |update| / lr over every rank's master weights, and the elements beyond 10 x lr
            "update_over_lr": [None if step[0] is None else max(rank[0] for rank in step) for step in zip(*sizes)],
            "updates_beyond_10_lr": [0 if step[0] is None else sum(rank[1] for rank in step) for step in zip(*sizes)],
            "phases_s": phases,
            **checkpoint_sizes(args.ckpt_dir),
        }
    # collectives below run on every rank
    result_losses = mean_over_ranks(losses)
    result_valid = mean_over_ranks([valid])[0]
    if rank == 0:
        result.update(losses=result_losses, valid_loss=result_valid)
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
    # the result is written: leave the group and exit without the interpreter's teardown, where torch's gloo group can
    # abort (SIGABRT) a finished job (deepspeed_bnb/utils/teardown.py)
    finish()
