"""Demo: train a small byte-level GPT on the Python standard library's source with bnb AdamW8bit under DeepSpeed ZeRO.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config configs/zero2_adamw8bit.json
    torchrun --nproc_per_node 2 examples/train.py --deepspeed_config configs/zero2_adamw8bit.json

On a CPU-only machine both launch CPU ranks (DeepSpeed's CPU accelerator, gloo). The only deepspeed_bnb-specific line
is `import deepspeed_bnb`; the rest is a plain DeepSpeed training script.
"""

import argparse
import os
import sys
import time

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm as dist
from tqdm import tqdm

import deepspeed_bnb  # noqa: F401  (teaches DeepSpeed the bnb_* keys and the block-aware ZeRO optimizer)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, decay_groups  # noqa: E402
from stdlib_text import ByteBatches, stdlib_bytes  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW8bit (default 3e-3)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--save_dir", default="checkpoints/demo", help="where the final checkpoint goes")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    parser.add_argument("--resume", default=None, help="checkpoint directory to continue from (saved at any number "
                        "of ranks)")
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


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
    torch.manual_seed(args.seed)
    cfg = GPTConfig(width=args.width, depth=args.depth, heads=max(1, args.width // 32))
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    optimizer = bnb.optim.AdamW8bit(decay_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = ByteBatches(stdlib_bytes(), cfg.context)
    generator = torch.Generator().manual_seed(1000 * args.seed + rank)
    if args.resume:
        path, _ = engine.load_checkpoint(args.resume)
        if path is None:
            raise FileNotFoundError(f"--resume {args.resume}: no checkpoint there (no 'latest' file)")
        if rank == 0:
            print(f"resumed {path} at step {engine.global_steps} on {world} ranks", flush=True)
    if rank == 0:
        print(f"{type(engine.optimizer).__name__} over {world} ranks, {engine.optimizer.bnb_update_summary()}, "
              f"{n_params:,} parameters, "
              f"{len(batches.train):,} training bytes of stdlib source", flush=True)

    bar = tqdm(range(args.steps), disable=rank != 0, desc="train", dynamic_ncols=True)
    started = time.time()
    for _ in bar:
        x, y = batches.sample("train", engine.train_micro_batch_size_per_gpu(), generator)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        bar.set_postfix(loss=f"{mean_over_ranks(loss.item()):.3f}", lr=f"{engine.get_lr()[0]:.1e}")
    elapsed = time.time() - started

    engine.eval()
    with torch.no_grad():
        valid = mean_over_ranks(sum(engine(*batches.sample("valid", 8, generator)).item() for _ in range(8)) / 8)
    engine.train()
    engine.save_checkpoint(args.save_dir)
    report = memory_report(engine, n_params)
    if rank == 0:
        print(f"\n{args.steps} steps in {elapsed:.0f} s; validation loss {valid:.3f} nats/byte "
              f"({valid / 0.6931:.2f} bits/byte); checkpoint saved to {args.save_dir}\n{report}", flush=True)
    # torch's gloo group can abort at interpreter exit once a peer has left; end it explicitly
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
