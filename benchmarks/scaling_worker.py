"""One DP size of scaling.py: for ZeRO-1/2 x (fp32 torch AdamW, bnb AdamW8bit), a few fp32 steps, bytes by role.

Every rank builds each engine in turn, samples tensor_census.PeakSampler over a few steps (random tokens: no data
set in memory), and rank 0 writes every rank's peaks to one JSON file.
"""

import argparse
import gc
import json
import os
import sys

import bitsandbytes as bnb
import deepspeed
import torch
import torch.distributed as tdist

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
from deepspeed_bnb.utils.teardown import finish

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tensor_census import PeakSampler, census, live_storages

OPTIMIZERS = {
    "torch_adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95)),
    "bnb8": lambda groups: bnb.optim.AdamW8bit(groups, lr=1e-3, betas=(0.9, 0.95)),
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps sampled (state exists from the first step on)")
    p.add_argument("--bucket", type=int, default=1 << 16, help="reduce_bucket_size and allgather_bucket_size")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    p.add_argument("--local_rank", type=int, default=0)
    return p.parse_args()


def measure(args, stage: int, optimizer: str) -> dict:
    baseline = live_storages()  # earlier engines' leftovers are not this engine's
    torch.manual_seed(0)
    cfg = GPTConfig(context=args.context, width=args.width, depth=args.depth, heads=max(1, args.width // 32))
    model = GPT(cfg)
    groups = decay_groups(model, 0.1)
    numels = [[p.numel() for p in g["params"]] for g in groups]  # before ZeRO swaps in its flat partitions
    ds_config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                                       "allgather_bucket_size": args.bucket}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=OPTIMIZERS[optimizer](groups), config=ds_config)
    sampler = PeakSampler(engine, baseline)
    generator = torch.Generator().manual_seed(tdist.get_rank())
    for _ in range(args.steps):
        x = torch.randint(0, cfg.vocab, (args.batch, cfg.context), generator=generator)
        engine.backward(engine(x, x))
        engine.step()
    sampler.close()
    after = census(engine)  # between steps: what stays allocated
    zero = engine.optimizer
    out = {
        "stage": stage, "optimizer": optimizer,
        "zero_optimizer": type(zero).__name__, "base_optimizer": type(zero.optimizer).__name__,
        "peak": sampler.peak, "peak_at": sampler.where, "between_steps": after, "unclaimed_in_step": sampler.unclaimed,
        "group_numels": numels,
        "n_params": sum(p.numel() for p in model.parameters()),
    }
    del engine, sampler, zero
    gc.collect()
    return out


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = []
    for stage in args.stages:
        for optimizer in OPTIMIZERS:
            mine = measure(args, stage, optimizer)
            per_rank = [None] * tdist.get_world_size()
            tdist.all_gather_object(per_rank, mine)
            per_rank_keys = ("peak", "peak_at", "between_steps", "unclaimed_in_step")
            results.append({k: v for k, v in mine.items() if k not in per_rank_keys}
                           | {"per_rank": [{k: r[k] for k in per_rank_keys} for r in per_rank]})
    if tdist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"world": tdist.get_world_size(), "bucket": args.bucket,
                       "model": {"width": args.width, "depth": args.depth, "context": args.context},
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
    # the result is written: leave the group and exit without the interpreter's teardown, where torch's gloo group can
    # abort (SIGABRT) a finished job (deepspeed_bnb/utils/teardown.py)
    finish()
