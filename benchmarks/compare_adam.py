"""bnb AdamW8bit through deepspeed_bnb against 32-bit Adams: memory, checkpoint size, speed and loss under ZeRO-2 or 3.

Trains the demo's byte-level GPT (deepspeed_bnb/demo/gpt.py) on the stdlib's source (deepspeed_bnb/demo/text.py) on 2
CPU ranks, once per optimizer, each as its own torchrun job (so peak RSS is per configuration), with the same model
init, data, schedule and hyper-parameters:
  bnb8_fused     bnb.optim.AdamW8bit via deepspeed_bnb, fused 8-bit kernel      (bnb_fused_kernel: true)
  bnb8_fallback  bnb.optim.AdamW8bit via deepspeed_bnb, bnb's own update        (bnb_fused_kernel: false)
  torch_adamw    torch.optim.AdamW, fp32 state, stock ZeRO-2 (deepspeed_bnb leaves it alone)
  torch_adamw_fused  the same with fused=True (torch's single-kernel step; not in the default set)
  ds_adamw       DeepSpeed's own Adam from the config's "optimizer" section (the class that ran is reported)
With --bf16 the model trains in bf16 and the configurations are the master weights a memory-bound user can pick:
  torch_adamw              torch AdamW, DeepSpeed's fp32 master weights and fp32 states (the reference)
  ds_bf16_states           torch AdamW with DeepSpeed's bf16_master_weights_and_grads + bf16_optimizer_states
  bnb8_fused               bnb.optim.AdamW8bit via deepspeed_bnb, fp32 master weights (the default path)
  bnb8_master_bf16         ... bnb_master_weights: "bf16"
  bnb8_master_compensated  ... bnb_master_weights: "bf16+8" (bf16 + an 8-bit error term)
and the tables add bytes per parameter of master weights, state and (peak) gradients, from the live tensors.
Writes compare_adam.md (tables), compare_adam.json (everything measured), loss.png and memory.png.

    python benchmarks/compare_adam.py            # demo model, 200 steps per optimizer (a few minutes on 2 cores)
    python benchmarks/compare_adam.py --quick    # tiny model, 30 steps: a smoke test (about a minute)
    python benchmarks/compare_adam.py --stage 3  # the same under ZeRO-3 (results in benchmarks/results/stage3)
    python benchmarks/compare_adam.py --stage 3 --offload   # optimizer state in host memory (DeepSpeedCPUAdam for
                                                 # DeepSpeed's Adam); results in benchmarks/results/stage3_offload
    python benchmarks/compare_adam.py --bf16     # master weights of a bf16 model (results/bf16); --lr 3e-4: a low
                                                 # learning rate (results/bf16_lr3e-4)
    python benchmarks/compare_adam.py --configs bnb8_fused torch_adamw_fused --rounds 3 --steps 60
                                                 # speed alone: the configurations interleaved in 3 rounds, each
                                                 # time the median of the rounds' medians (results/speed_rounds3)
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_adam_configs import BF16_ONLY, CONFIGS, DEFAULT, DEFAULT_BF16
from compare_adam_report import environment, write_report
from launch import torchrun

FULL = {"width": 128, "depth": 4, "context": 128, "batch": 16, "steps": 200, "warmup_lr_steps": 20,
        "timing_skip": 10, "valid_batches": 16}
QUICK = {"width": 64, "depth": 2, "context": 64, "batch": 8, "steps": 30, "warmup_lr_steps": 10,
         "timing_skip": 5, "valid_batches": 4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and few steps (CI smoke test)")
    p.add_argument("--out", help="output folder (default benchmarks/results, quick: benchmarks/results/quick)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, help=f"default: {' '.join(DEFAULT)}; with --bf16: "
                   f"{' '.join(DEFAULT_BF16)}")
    p.add_argument("--bf16", action="store_true", help="train a bf16 model (DeepSpeed's bf16 section)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    p.add_argument("--steps", type=int, help="override the preset's steps per optimizer")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel CPU ranks (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage of every configuration")
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU in every configuration")
    p.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, interleaved (the "
                   "order reversed every other round); the step times are the median of the rounds' medians (each "
                   "round's in the JSON)")
    args = p.parse_args()
    args.preset = dict(QUICK if args.quick else FULL)
    if args.steps:
        args.preset["steps"] = args.steps
    if args.lr:
        args.preset["lr"] = args.lr
    args.configs = args.configs or list(DEFAULT_BF16 if args.bf16 else DEFAULT)
    if not args.bf16 and set(args.configs) & set(BF16_ONLY):
        p.error(f"{', '.join(sorted(set(args.configs) & set(BF16_ONLY)))} keep bf16 master weights: add --bf16")
    variant = "_".join(filter(None, ["stage3" if args.stage == 3 else "", "offload" if args.offload else "",
                                     "bf16" if args.bf16 else "", f"lr{args.lr:g}" if args.lr else "",
                                     f"{args.steps}steps" if args.steps and not args.quick else "",
                                     f"speed_rounds{args.rounds}" if args.rounds > 1 else ""]))
    args.out = args.out or os.path.join(HERE, "results", "quick" if args.quick else "", variant)
    return args


def run_config(config: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint is measured, then discarded
        result = os.path.join(tmp, "result.json")
        flags = [f"--{k}={v}" for k, v in args.preset.items()]
        wall = torchrun(os.path.join(HERE, "compare_adam_worker.py"), args.nproc,
                        timeout=max(900, 3 * args.preset["steps"]),  # a long run on a busy machine: 3 s per step
                        args=["--config", config, "--result", result, "--ckpt_dir", os.path.join(tmp, "ckpt"),
                              "--seed", args.seed, "--stage", args.stage, "--offload", int(args.offload),
                              "--bf16", int(args.bf16), *flags])
        with open(result) as f:
            return json.load(f) | {"job_wall_s": wall}


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    results, rounds = {}, {config: [] for config in args.configs}
    for index in range(args.rounds):  # interleaved: a slow spell of a shared machine hits every configuration alike
        # and in turn-about order (A B, B A, ...): no configuration always runs first, or always after the same job
        for config in args.configs if index % 2 == 0 else args.configs[::-1]:
            load = os.getloadavg()[0]  # the machine may be shared: say how busy it was when each job started
            r = run_config(config, args) | {"load_avg_1min_at_start": load}
            rounds[config].append(r)
            print(f"{config:14s} {r['job_wall_s']:5.1f} s  engine.step() {1e3 * r['median_engine_step_s']:.1f} ms  "
                  f"{r['update_path']}", flush=True)
    for config, runs in rounds.items():
        results[config] = dict(runs[0])
        if len(runs) > 1:
            for key in ("median_step_s", "median_engine_step_s"):
                results[config][key] = statistics.median(r[key] for r in runs)
                results[config][f"{key}_rounds"] = [r[key] for r in runs]
    meta = {"preset": args.preset, "quick": args.quick, "nproc": args.nproc, "seed": args.seed, "stage": args.stage,
            "offload": args.offload, "bf16": args.bf16, "rounds": args.rounds,
            "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
            "total_wall_s": time.perf_counter() - started, "environment": environment()}
    with open(os.path.join(args.out, "compare_adam.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(write_report(results, meta, args.out))


if __name__ == "__main__":
    main()
