"""One side of a checkpoint's trip between two DeepSpeed releases (tests/distributed/test_cross_release.py), under
whichever DeepSpeed this Python has; launched under torchrun (any number of ranks).

  save    train 3 steps at --stage, save tag "a", train 2 more (the uninterrupted run), save tag "a_later" (control)
  reload  load --src (tag --src-tag) at --stage, save tag "b" at once, train the 2 steps the saving run trained next
Rank 0 writes --out/result.json: the losses, the DeepSpeed release and the optimizer class.
"""

import argparse
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

import bitsandbytes as bnb  # noqa: E402
import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402

import deepspeed_bnb  # noqa: E402,F401
from deepspeed_bnb.utils import teardown  # noqa: E402
from support.distributed_scenarios import run_steps  # noqa: E402
from support.toy import ds_config, make_model, param_groups  # noqa: E402

TRAINED, CONTINUED = range(3), range(3, 5)


def build(world: int, stage: int):
    model = make_model(0)
    optimizer = bnb.optim.AdamW8bit(param_groups(model), min_8bit_size=1000)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(world, stage=stage))[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "reload"))
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--src", default="")
    parser.add_argument("--src-tag", default="a")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    world, rank = dist.get_world_size(), dist.get_rank()
    engine = build(world, args.stage)
    if args.mode == "save":
        run_steps(engine, TRAINED, world, rank)
        engine.save_checkpoint(args.out, tag="a")
        losses = run_steps(engine, CONTINUED, world, rank)
        engine.save_checkpoint(args.out, tag="a_later")
    else:
        engine.load_checkpoint(args.src, tag=args.src_tag)
        engine.save_checkpoint(args.out, tag="b")
        losses = run_steps(engine, CONTINUED, world, rank)
    if rank == 0:
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"losses": losses, "deepspeed": deepspeed.__version__,
                       "optimizer": type(engine.optimizer).__name__}, f)
    teardown.finish()


if __name__ == "__main__":
    main()
