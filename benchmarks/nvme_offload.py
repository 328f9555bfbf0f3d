"""NVMe offload of the optimizer (ZeRO-Infinity) with bnb AdamW8bit against 32-bit Adams: bytes to and from NVMe per
step, step time and host memory, side by side in one run.

An MLP (bf16, ZeRO-3, `offload_optimizer: {"device": "nvme"}`) trains on 2 CPU ranks, once per configuration, each
its own torchrun job (benchmarks/nvme_offload_worker.py), with the same model, data and hyper-parameters:
  bnb8         bnb.optim.AdamW8bit through deepspeed_bnb (fp32 master weights, 8-bit state swapped by deepspeed_bnb)
  bnb8_bf16    the same with bf16 master weights (`"bnb_master_weights": "bf16"`: DeepSpeed swaps them, and the
               gradients, in bf16)
  bnb8_bf16+8  the same with compensated master weights (`"bf16+8"`: bf16, and their int8 error terms swapped by
               deepspeed_bnb with the state)
  torch_adamw  torch.optim.AdamW as the client optimizer, stock ZeRO-3 (fp32 master weights and moments)
  ds_cpuadam   DeepSpeed's AdamW from the config's "optimizer" section (DeepSpeedCPUAdam under offload)
Bytes are counted at the async_io handles every swapper of the process uses (the worker's docstring says how): what
one rank reads from and writes to its NVMe folder per step, averaged over the steps after the first ones (which
create the files). Step time is the median of those steps on this machine (a busy 2-core VM: compare within one run).

    python benchmarks/nvme_offload.py               # hidden 2048, 4 layers (17M parameters), 8 steps: a few minutes
    python benchmarks/nvme_offload.py --quick       # hidden 1024, 6 steps
Writes benchmarks/results/nvme_offload/nvme_offload.md (the table) and nvme_offload.json. Needs libaio (DeepSpeed's
async_io op) and, for ds_cpuadam, DeepSpeed's CPU Adam (JIT-built on first use).
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import torchrun  # noqa: E402

CONFIGS = ("bnb8", "bnb8_bf16", "bnb8_bf16+8", "torch_adamw", "ds_cpuadam")
REFERENCE = "torch_adamw"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "nvme_offload"))
    p.add_argument("--nvme", help="folder for the swap files (default: a temporary one under /tmp)")
    args = p.parse_args()
    args.shape = {"hidden": 1024, "depth": 4, "steps": 6, "skip": 2} if args.quick else \
        {"hidden": 2048, "depth": 4, "steps": 8, "skip": 3}
    return args


def table(results: dict) -> str:
    ref = results[REFERENCE]["ranks"][0] if REFERENCE in results else None
    params = next(iter(results.values()))["params"]
    world = next(iter(results.values()))["world"]
    lines = [f"{params / 1e6:.1f}M parameters, {world} ranks; per rank and step, after the first steps:", "",
             "| configuration | optimizer that stepped | written to NVMe (MB) | read from NVMe (MB) | vs torch AdamW | "
             "swap files (bytes/param) | step (s) | peak RSS (MB) | last loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        r = result["ranks"][0]
        ratio = f"{r['written_per_step'] / ref['written_per_step']:.2f}x" if ref else "n/a"
        lines.append(f"| {name} | {r['optimizer']} ({r['zero']}) | {r['written_per_step'] / 1e6:.1f} | "
                     f"{r['read_per_step'] / 1e6:.1f} | {ratio} | {r['swap_file_bytes'] / (params / world):.2f} | "
                     f"{r['step_s']:.3f} | {r['peak_rss'] / 2**20:.0f} | {r['losses'][-1]:.4f} |")
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(dir=args.nvme) as swap:
        for config in args.configs:
            result = os.path.join(swap, f"{config}.json")
            torchrun(os.path.join(HERE, "nvme_offload_worker.py"), 2,
                     ["--config", config, "--nvme", os.path.join(swap, config), "--result", result,
                      *[f"--{k}={v}" for k, v in args.shape.items()]],
                     log_path=os.path.join(args.out, f"{config}.log"))
            with open(result) as f:
                results[config] = json.load(f)
    text = table(results)
    print(text)
    with open(os.path.join(args.out, "nvme_offload.md"), "w") as f:
        f.write(f"# NVMe offload of the optimizer: bnb AdamW8bit against 32-bit Adams\n\n`python "
                f"benchmarks/nvme_offload.py{' --quick' if args.quick else ''}` ({args.shape}).\n\n{text}")
    with open(os.path.join(args.out, "nvme_offload.json"), "w") as f:
        json.dump({"shape": args.shape, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
