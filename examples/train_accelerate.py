"""Demo: the byte-level GPT with bnb AdamW8bit under DeepSpeed ZeRO-2, driven by Hugging Face Accelerate.

    accelerate launch --config_file configs/accelerate_zero2.yaml examples/train_accelerate.py --save_at 50
    accelerate launch --config_file configs/accelerate_zero2.yaml --num_processes 1 examples/train_accelerate.py \
        --resume checkpoints/accelerate --save_dir checkpoints/accelerate_1rank

The first trains 100 steps on 2 CPU ranks, saving with `accelerator.save_state` after step 50; the second repeats
steps 51-100 on one rank from that state (`accelerator.load_state`; the checkpoint reshards itself), with the same
losses. As in train.py, the only deepspeed_bnb-specific line is `import deepspeed_bnb`; the DeepSpeed config
(configs/zero2_accelerate.json) holds the bnb_* keys. The global batch (--global_batch) is split over however many
ranks run, so every step sees the same sequences at any number of ranks.
"""

import argparse
import json

import bitsandbytes as bnb
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from deepspeed.accelerator import get_accelerator

import deepspeed_bnb  # noqa: F401  (teaches DeepSpeed the bnb_* keys; keeps bnb optimizers under Accelerate)
from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
from deepspeed_bnb.demo.text import ByteWindows, stdlib_bytes
from deepspeed_bnb.utils.teardown import finish


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the whole run; a resumed run "
                        "continues up to it (default 100)")
    parser.add_argument("--save_at", type=int, default=None, help="save after this step (default: after the last)")
    parser.add_argument("--save_dir", default="checkpoints/accelerate", help="where accelerator.save_state writes")
    parser.add_argument("--resume", default=None, help="directory written by accelerator.save_state, at any number "
                        "of ranks")
    parser.add_argument("--resume_without_optimizer_state", action="store_true", help="load weights, step and lr "
                        "schedule but start the optimizer afresh (what a lost optimizer state costs)")
    parser.add_argument("--global_batch", type=int, default=16, help="sequences per step over all ranks (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW8bit lr, when the config has no scheduler")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--context", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data seed (default 0)")
    parser.add_argument("--text_mb", type=int, default=8, help="MB of stdlib source to draw windows from (default 8)")
    parser.add_argument("--log_json", default=None, help="write the per-step losses and the optimizer classes here "
                        "(JSON)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # Accelerate 1.x picks a process-group backend only for GPU-like devices; on a CPU-only machine it leaves it
    # unset and then reports 1 process per rank (no data sharding, every rank "main") although DeepSpeed runs them
    # all in one gloo group. Naming DeepSpeed's backend for this device fixes that (on CUDA: nccl, the default).
    backend = InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name())
    accelerator = Accelerator(kwargs_handlers=[backend])
    if args.global_batch % accelerator.num_processes:
        raise ValueError(f"--global_batch {args.global_batch} does not split over {accelerator.num_processes} ranks")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(context=args.context, width=args.width, depth=args.depth, heads=max(1, args.width // 32))
    model = GPT(cfg)
    optimizer = bnb.optim.AdamW8bit(decay_groups(model, 0.1), lr=args.lr, betas=(0.9, 0.95))
    windows = ByteWindows(stdlib_bytes(args.text_mb << 20), cfg.context, args.steps * args.global_batch,
                          seed=args.seed)
    # Accelerate gives rank r the batches r, r + world, ...: per-rank batches of global_batch / world make every
    # step's global batch the same windows at any world size. The DeepSpeed config's micro batch is "auto" (this).
    loader = torch.utils.data.DataLoader(windows, batch_size=args.global_batch // accelerator.num_processes)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    start = 0
    if args.resume:
        # load_state passes extra keywords to DeepSpeed's engine.load_checkpoint
        accelerator.load_state(args.resume, load_optimizer_states=not args.resume_without_optimizer_state)
        start = engine.global_steps
    log = {"world": accelerator.num_processes, "start": start, "losses": [],
           "optimizer": type(engine.optimizer).__name__, "basic_optimizer": type(engine.basic_optimizer).__name__,
           "offload": bool(engine.zero_cpu_offload())}
    accelerator.print(f"{log['optimizer']} over {log['basic_optimizer']} on {log['world']} ranks"
                      f"{' (optimizer offloaded to CPU)' if log['offload'] else ''}, steps {start}..{args.steps}")

    batches = accelerator.skip_first_batches(loader, start) if start else loader
    for step, window in zip(range(start, args.steps), batches):
        loss = engine(window[:, :-1], window[:, 1:])
        accelerator.backward(loss)  # DeepSpeed: engine.backward and engine.step
        optimizer.step()  # no-ops under DeepSpeed (the engine stepped); kept for the usual Accelerate loop shape
        optimizer.zero_grad()
        log["losses"].append(accelerator.reduce(loss.detach(), "mean").item())
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            accelerator.print(f"step {step + 1}: loss {log['losses'][-1]:.4f}, lr {engine.get_lr()[0]:.2e}")
        if step + 1 == (args.save_at or args.steps):
            accelerator.save_state(args.save_dir)
            accelerator.print(f"saved {args.save_dir} after step {step + 1}")
    if args.log_json and accelerator.is_main_process:
        with open(args.log_json, "w") as f:
            json.dump(log, f)
    accelerator.wait_for_everyone()
    return log


if __name__ == "__main__":
    main()
    # torch's gloo group can abort in C++ at interpreter exit (SIGABRT) after a finished run, and the launcher would
    # report a failure: leave the group and exit without the interpreter's teardown (deepspeed_bnb/utils/teardown.py)
    finish()
