"""Demo: train a small byte-level GPT on the Python standard library's source with bnb AdamW8bit under DeepSpeed ZeRO.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/zero2_adamw8bit.json
    torchrun --nproc_per_node 2 examples/train.py --deepspeed_config configs/zero2_adamw8bit.json

On a CPU-only machine both launch CPU ranks (DeepSpeed's CPU accelerator, gloo). The only deepspeed_bnb-specific line
is `import deepspeed_bnb`; the rest is a plain DeepSpeed training script.

Elastic: under torchrun's elastic agent (`--nnodes 1:2 --rdzv-backend c10d --max-restarts K`, docs/elastic.md) the
workers are restarted at another world size when a node is lost or comes back; with `--resume auto` they load the
latest complete checkpoint of `--save_dir` at the new size and go on. The global batch stays
`--global_batch` sequences (micro-batch and gradient accumulation follow the world size) and the data of each step is
a function of the step alone, so the run trains what an uninterrupted one would.
"""

import argparse
import json
import os
import time

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm as dist
from tqdm import tqdm

import deepspeed_bnb  # noqa: F401  (teaches DeepSpeed the bnb_* keys and the block-aware ZeRO optimizer)
from deepspeed_bnb.demo.elastic import (Events, HeldOut, SaveCadence, batch_plan, hold_here, parse_holds, rank_rows,
                                        step_windows, windows)
from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
from deepspeed_bnb.demo.text import ByteBatches, stdlib_bytes
from deepspeed_bnb.utils.teardown import finish


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="train until this global step (default 300)")
    parser.add_argument("--global_batch", type=int, default=32,
                        help="sequences per optimizer step, at any world size (default 32); the config's "
                             "train_micro_batch_size_per_gpu is the largest micro-batch, gradient accumulation "
                             "makes up the rest")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW8bit (default 3e-3)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--save_dir", default="checkpoints/demo", help="where checkpoints go")
    parser.add_argument("--save_every", type=int, default=0, help="also save every N steps (default: at the end)")
    parser.add_argument("--save_seconds", type=float, default=0, help="also save every T seconds of training")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep in --save_dir (default 3; the "
                        "newest complete one is never deleted)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    parser.add_argument("--resume", default=None, help="checkpoint directory to continue from (saved at any number "
                        "of ranks); 'auto': --save_dir's latest checkpoint if it has one (what restarted elastic "
                        "workers need), else start afresh")
    parser.add_argument("--resume_weights_only", action="store_true",
                        help="load only the weights and step (fresh optimizer state): a control for comparisons")
    parser.add_argument("--events", default=None, help="append a JSON line per event (start, step, save, "
                        "validation, done) to this file (rank 0)")
    parser.add_argument("--min_step_seconds", type=float, default=0,
                        help="pace the run: at least this long per step (tests and demos of failures)")
    parser.add_argument("--hold_at", action="append", default=[], metavar="STEP@WORLD",
                        help="at step STEP (after its checkpoint, if one is due, or on resuming there), when "
                             "running on WORLD ranks: log a 'hold' event and wait at that step boundary until the "
                             "job changes size (a peer lost, or the elastic agent restarting the workers for a node "
                             "that joined), so that a failure lands at a known step (tests and demos of failures); "
                             "repeatable")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def sum_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item()


def ds_config(args, world: int) -> dict:
    """The DeepSpeed config file with the batch sizes for this world size (the global batch fixed)."""
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    micro, accumulation = batch_plan(args.global_batch, world, config.get("train_micro_batch_size_per_gpu", 16))
    config.update(train_batch_size=args.global_batch, train_micro_batch_size_per_gpu=micro,
                  gradient_accumulation_steps=accumulation)
    return config


def resume_from(args):
    if args.resume != "auto":
        return args.resume
    return args.save_dir if os.path.isfile(os.path.join(args.save_dir, "latest")) else None


def memory_report(engine, n_params: int) -> str:
    """Optimizer-state bytes per rank, measured from the state tensors, next to 32-bit AdamW's 8 bytes/element."""
    opt = engine.optimizer
    mine = torch.tensor([opt.bnb_state_bytes(), opt.bnb_partition_numel()], dtype=torch.float64)
    rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    padding = sum(layout.padding_numel for layout in opt.bnb_layouts)
    lines = [f"optimizer state per rank ({n_params:,} parameters, {len(rows)} ranks, "
             f"block-alignment padding {padding:,} elements = {100 * padding / n_params:.2f}%)",
             f"{'rank':>4} | {'elements':>10} | {'bnb 8-bit state':>15} | {'32-bit AdamW':>12} | ratio"]
    for rank, (state_bytes, elements) in enumerate(r.tolist() for r in rows):
        adamw = 8 * elements  # exp_avg + exp_avg_sq, fp32, for the same elements
        lines.append(f"{rank:>4} | {int(elements):>10,} | {state_bytes / 2**20:>12.2f} MB | "
                     f"{adamw / 2**20:>9.2f} MB | {state_bytes / adamw:.3f}x")
    return "\n".join(lines)


def main():
    args = parse_args()
    holds = parse_holds(args.hold_at)
    started_at = time.time()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(width=args.width, depth=args.depth, heads=max(1, args.width // 32))
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    optimizer = bnb.optim.AdamW8bit(decay_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config, args.deepspeed_config = ds_config(args, world), None
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, config=config)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    events = Events(args.events)
    batches = ByteBatches(stdlib_bytes(), cfg.context)
    held_out = HeldOut(batches.valid, cfg.context)
    source = resume_from(args)
    if source:
        path, _ = engine.load_checkpoint(source, load_optimizer_states=not args.resume_weights_only)
        if path is None:
            raise FileNotFoundError(f"--resume {args.resume}: no checkpoint there (no 'latest' file)")
        valid = held_out.loss(engine)  # the same windows at every world size: comparable with the saving run's
        events.log("valid", step=engine.global_steps, world=world, valid=valid)
        if rank == 0:
            print(f"resumed {path} at step {engine.global_steps} on {world} ranks; held-out loss {valid:.4f} "
                  f"nats/byte", flush=True)
    # before anything is trained: an elastic round that formed before every node had joined holds at its first step
    # and is replaced by the full one without having started
    hold_here(holds, engine.global_steps, world, events)
    events.log("start", world=world, step=engine.global_steps, micro=micro, accumulation=accumulation,
               resumed=bool(source), setup_seconds=round(time.time() - started_at, 2),
               restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    if rank == 0:
        print(f"{type(engine.optimizer).__name__} over {world} ranks ({args.global_batch} sequences per step: "
              f"{micro} x {accumulation} accumulation x {world} ranks), {engine.optimizer.bnb_update_summary()}, "
              f"{n_params:,} parameters, {len(batches.train):,} training bytes of stdlib source", flush=True)

    cadence = SaveCadence(args.save_every, args.save_seconds)
    bar = tqdm(range(engine.global_steps, args.steps), disable=rank != 0, desc="train", dynamic_ncols=True,
               initial=engine.global_steps, total=args.steps)
    started = time.time()
    for step in bar:
        step_began = time.time()
        starts = step_windows(len(batches.train), cfg.context, args.global_batch, step, args.seed)
        loss_sum = 0.0
        for micro_step in range(accumulation):
            x, y = windows(batches.train, rank_rows(starts, micro, micro_step, rank, world), cfg.context)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item() * micro
        loss = sum_over_ranks(loss_sum) / args.global_batch
        events.log("step", step=engine.global_steps, loss=loss, world=world)
        bar.set_postfix(loss=f"{loss:.3f}", lr=f"{engine.get_lr()[0]:.1e}")
        if engine.global_steps < args.steps and cadence.due(engine.global_steps):
            save(engine, args, held_out, events, world)
            cadence.saved()
        if args.min_step_seconds:
            time.sleep(max(0.0, args.min_step_seconds - (time.time() - step_began)))
        hold_here(holds, engine.global_steps, world, events)
    elapsed = time.time() - started

    valid = save(engine, args, held_out, events, world)
    report = memory_report(engine, n_params)
    events.log("done", step=engine.global_steps, world=world, valid=valid)
    if rank == 0:
        print(f"\n{engine.global_steps} steps ({args.steps - bar.initial} in this run, {elapsed:.0f} s); held-out loss "
              f"{valid:.4f} nats/byte ({valid / 0.6931:.3f} bits/byte); checkpoint saved to {args.save_dir}\n{report}",
              flush=True)


def save(engine, args, held_out, events, world) -> float:
    """Held-out loss, then a checkpoint (tag global_step<N>), then prune to --keep; returns the held-out loss."""
    valid = held_out.loss(engine)
    began = time.time()
    engine.save_checkpoint(args.save_dir, tag=f"global_step{engine.global_steps}")
    seconds = time.time() - began
    if dist.get_rank() == 0:
        from deepspeed_bnb.checkpoint.format.retention import prune
        prune(args.save_dir, args.keep)
        print(f"\nstep {engine.global_steps}: held-out loss {valid:.4f} nats/byte; saved in {seconds:.2f} s",
              flush=True)
    events.log("save", step=engine.global_steps, world=world, valid=valid, seconds=round(seconds, 3))
    return valid


if __name__ == "__main__":
    main()
    # torch's gloo group can abort in C++ at interpreter exit (SIGABRT, "terminate called without an active
    # exception") after a finished run; the launcher would call the run failed (and an elastic agent would restart
    # it): leave the group and exit without the interpreter's teardown
    finish()
