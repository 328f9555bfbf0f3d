"""bnb AdamW8bit through deepspeed_bnb against 32-bit Adams: memory, checkpoint size, speed and loss under ZeRO-2 or 3.

Trains the demo's byte-level GPT (examples/gpt.py) on the stdlib's source (examples/stdlib_text.py) on 2 CPU ranks,
once per optimizer, each as its own torchrun job (so peak RSS is per configuration), with the same model init, data,
schedule and hyper-parameters:
  bnb8_fused     bnb.optim.AdamW8bit via deepspeed_bnb, fused 8-bit kernel      (bnb_fused_kernel: true)
  bnb8_fallback  bnb.optim.AdamW8bit via deepspeed_bnb, bnb's own update        (bnb_fused_kernel: false)
  torch_adamw    torch.optim.AdamW, fp32 state, stock ZeRO-2 (deepspeed_bnb leaves it alone)
  ds_adamw       DeepSpeed's own Adam from the config's "optimizer" section (the class that ran is reported)
Writes compare_adam.md (tables), compare_adam.json (everything measured), loss.png and memory.png.

    python benchmarks/compare_adam.py            # demo model, 200 steps per optimizer (a few minutes on 2 cores)
    python benchmarks/compare_adam.py --quick    # tiny model, 30 steps: a smoke test (about a minute)
    python benchmarks/compare_adam.py --stage 3  # the same under ZeRO-3 (results in benchmarks/results/stage3)
    python benchmarks/compare_adam.py --stage 3 --offload   # optimizer state in host memory (DeepSpeedCPUAdam for
                                                 # DeepSpeed's Adam); results in benchmarks/results/stage3_offload
"""

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_adam_configs import CONFIGS
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
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--steps", type=int, help="override the preset's steps per optimizer")
    p.add_argument("--nproc", type=int, default=2, help="data-parallel CPU ranks (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", type=int, choices=(2, 3), default=2, help="ZeRO stage of every configuration")
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the CPU in every configuration")
    args = p.parse_args()
    args.preset = dict(QUICK if args.quick else FULL)
    if args.steps:
        args.preset["steps"] = args.steps
    variant = "_".join(filter(None, ["stage3" if args.stage == 3 else "", "offload" if args.offload else ""]))
    args.out = args.out or os.path.join(HERE, "results", "quick" if args.quick else "", variant)
    return args


def run_config(config: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:  # the checkpoint is measured, then discarded
        result = os.path.join(tmp, "result.json")
        flags = [f"--{k}={v}" for k, v in args.preset.items()]
        wall = torchrun(os.path.join(HERE, "compare_adam_worker.py"), args.nproc,
                        ["--config", config, "--result", result, "--ckpt_dir", os.path.join(tmp, "ckpt"),
                         "--seed", args.seed, "--stage", args.stage, "--offload", int(args.offload), *flags])
        with open(result) as f:
            return json.load(f) | {"job_wall_s": wall}


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    results = {}
    for config in args.configs:
        load = os.getloadavg()[0]  # the machine may be shared: say how busy it was when each job started
        results[config] = run_config(config, args) | {"load_avg_1min_at_start": load}
        r = results[config]
        print(f"{config:14s} {r['job_wall_s']:5.1f} s  {r['update_path']}", flush=True)
    meta = {"preset": args.preset, "quick": args.quick, "nproc": args.nproc, "seed": args.seed, "stage": args.stage,
            "offload": args.offload,
            "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
            "total_wall_s": time.perf_counter() - started, "environment": environment()}
    with open(os.path.join(args.out, "compare_adam.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(write_report(results, meta, args.out))


if __name__ == "__main__":
    main()
