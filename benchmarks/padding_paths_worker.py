"""One rank of padding_paths.py: the same GPT under ZeRO-1/2 with both ways of placing the block-aligned layout, built
side by side in one process and stepped in turns; rank 0 writes a JSON result.

"param_padding": DeepSpeed's own per-parameter padding (0.19.7 on); "tensors": zero padding tensors between the
parameters (what releases before 0.19.7 get). DEEPSPEED_BNB_ZERO_PADDING picks one per engine at construction.
"""

import argparse
import json
import os
import statistics
import time

import bitsandbytes as bnb
import deepspeed
import torch
import torch.distributed as tdist

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
from deepspeed_bnb.runtime.zero.compat import PADDING_ENV, PADDING_TENSORS, PARAM_PADDING
from deepspeed_bnb.runtime.zero.padding_tensors import is_padding
from deepspeed_bnb.utils.teardown import finish

MODES = (PARAM_PADDING, PADDING_TENSORS)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="micro batch per rank")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode (after 3 warm-up steps)")
    return p.parse_args()


def build(args, mode: str, world: int):
    os.environ[PADDING_ENV] = mode  # read when the ZeRO optimizer is constructed
    torch.manual_seed(0)
    model = GPT(GPTConfig(width=args.width, depth=args.depth, heads=4))
    optimizer = bnb.optim.AdamW8bit(decay_groups(model, 0.1), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    del os.environ[PADDING_ENV]
    assert engine.optimizer.bnb_padding_mode == mode
    return engine


def one_step(engine, tokens):
    """(backward seconds, step seconds): the gradient partitioning runs at the end of backward, the update in step."""
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    started = time.perf_counter()
    engine.backward(loss)
    middle = time.perf_counter()
    engine.step()
    return middle - started, time.perf_counter() - middle


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    world, rank = tdist.get_world_size(), tdist.get_rank()
    engines = {mode: build(args, mode, world) for mode in MODES}
    flat = {mode: [e.optimizer.bit16_groups_flat[i].clone() for i in range(len(e.optimizer.bit16_groups_flat))]
            for mode, e in engines.items()}
    tensors = {mode: sum(len(g) for g in e.optimizer.round_robin_bit16_groups) for mode, e in engines.items()}
    padding = {mode: sum(int(p.numel()) for g in e.optimizer.round_robin_bit16_groups for p in g if is_padding(p))
               for mode, e in engines.items()}
    params = sum(p.numel() for p in engines[PARAM_PADDING].module.parameters())
    total = sum(f.numel() for f in flat[PARAM_PADDING])
    g = torch.Generator().manual_seed(rank)
    times = {mode: {"backward": [], "step": []} for mode in MODES}
    losses = {mode: [] for mode in MODES}
    for step in range(3 + args.steps):
        tokens = torch.randint(0, 256, (args.batch, 129), generator=g)
        for mode in (MODES if step % 2 == 0 else MODES[::-1]):  # in turns, each first every other step
            backward, update = one_step(engines[mode], tokens)
            if step >= 3:
                times[mode]["backward"].append(backward)
                times[mode]["step"].append(update)
    same_weights = all(torch.equal(a.data, b.data) for a, b in zip(engines[PARAM_PADDING].module.parameters(),
                                                                    engines[PADDING_TENSORS].module.parameters()))
    if rank == 0:
        result = {"world": world, "stage": args.stage, "params": params, "flat_numel": total,
                  "padding_pct": 100.0 * (total - params) / params,
                  "same_flat_buffers": all(torch.equal(a, b) for a, b in zip(flat[PARAM_PADDING],
                                                                             flat[PADDING_TENSORS])),
                  "same_weights_after": same_weights, "tensors_in_flat_lists": tensors,
                  "padding_tensor_elements": padding, "deepspeed": deepspeed.__version__,
                  "median_ms": {mode: {k: 1000 * statistics.median(v) for k, v in t.items()}
                                for mode, t in times.items()}}
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    finish()


if __name__ == "__main__":
    main()
