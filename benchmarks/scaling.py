"""ZeRO-1/2/3 x (fp32 torch AdamW, bnb AdamW8bit): bytes per parameter per rank, measured at small DP, extrapolated.

Measures, at each DP size (one torchrun job of scaling_worker.py per size, CPU ranks, fp32), the bytes each rank holds
for optimizer state, gradients (peak) and fp32 master weights, from the live tensors (tensor_census.py); checks the
closed forms of scaling_model.py against those points; then evaluates the closed forms at larger DP for the measured
model and for Llama-2 7B's shapes. Writes scaling.md and scaling.json.

    python benchmarks/scaling.py                 # DP 1, 2, 4 on the demo GPT (1-2 minutes on 2 cores)
    python benchmarks/scaling.py --quick         # DP 1, 2 on a tiny GPT: a smoke test
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import torchrun
from padding_overhead import llama_shapes
from scaling_model import bytes_per_rank

SUM_ROLES = ("state", "gradients", "master")
COMBOS = [(1, "torch_adamw"), (1, "bnb8"), (2, "torch_adamw"), (2, "bnb8"), (3, "torch_adamw"), (3, "bnb8")]
LABEL = {"torch_adamw": "fp32 torch AdamW", "bnb8": "bnb AdamW8bit"}
DS_DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default, for the extrapolated model


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="DP 1 and 2, tiny model")
    p.add_argument("--dp", type=int, nargs="+", help="measured DP sizes (default 1 2 4; quick: 1 2)")
    p.add_argument("--extrapolate", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 1024])
    p.add_argument("--bucket", type=int, default=1 << 16, help="reduce_bucket_size of the measured runs")
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], help="ZeRO stages measured")
    p.add_argument("--out", help="output folder (default benchmarks/results, quick: benchmarks/results/quick)")
    args = p.parse_args()
    args.dp = args.dp or ([1, 2] if args.quick else [1, 2, 4])
    args.model = ["--width", "64", "--depth", "2", "--context", "64"] if args.quick else []
    args.out = args.out or os.path.join(HERE, "results", "quick" if args.quick else "")
    return args


def measure(args) -> dict:
    """DP size -> the worker's result."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            path = os.path.join(tmp, f"dp{dp}.json")
            wall = torchrun(os.path.join(HERE, "scaling_worker.py"), dp,
                            ["--result", path, "--bucket", args.bucket, "--stages", *args.stages, *args.model])
            with open(path) as f:
                runs[dp] = json.load(f) | {"wall_s": wall}
            print(f"measured DP={dp} in {wall:.0f} s", flush=True)
    return runs


def rows_measured(runs: dict, bucket: int) -> list:
    """One row per (DP, stage, optimizer): bytes/param on the busiest rank (max over ranks), and the formula."""
    rows = []
    for dp, run in sorted(runs.items()):
        for r in run["results"]:
            n, ranks = r["n_params"], r["per_rank"]
            busiest = max(ranks, key=lambda x: total(x["peak"]))
            model = {k: v / n for k, v in bytes_per_rank(r["group_numels"], dp, r["stage"], r["optimizer"],
                                                         bucket).items()}
            rows.append({"dp": dp, "stage": r["stage"], "optimizer": r["optimizer"], "n_params": n,
                         "zero_optimizer": r["zero_optimizer"], "base_optimizer": r["base_optimizer"],
                         "measured": {role: v / n for role, v in busiest["peak"].items()},
                         "per_rank_total": [total(x["peak"]) / n for x in ranks],
                         "formula": model, "gradient_peak_at": busiest["peak_at"]["gradients"],
                         "unclaimed_max_bytes": max(x["unclaimed_in_step"] for x in ranks)})
    return rows


def total(d: dict) -> float:
    return sum(d[role] for role in SUM_ROLES)


def measured_table(rows: list) -> str:
    n = rows[0]["n_params"]
    lines = [(f"Measured on CPU ranks (fp32, {n:,} parameters), bytes per parameter on the busiest rank; formula: "
              f"scaling_model.py; transient: its bound 4*(b + 2*largest tensor)/P on gradients."), "",
             ("| DP | ZeRO | optimizer | state | gradients (peak) | master | **state+grad+master** | formula | "
              "Δ vs formula | transient bound | weights (replicated) | bucket buffer |"),
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m, f = r["measured"], r["formula"]
        lines.append(f"| {r['dp']} | {r['stage']} | {LABEL[r['optimizer']]} | {m['state']:.3f} | "
                     f"{m['gradients']:.3f} | {m['master']:.3f} | **{total(m):.3f}** | {total(f):.3f} | "
                     f"{100 * (total(m) / total(f) - 1):+.1f}% | {f['transient_bound']:.2f} | {m['weights']:.3f} | "
                     f"{m['buckets']:.3f} |")
    return "\n".join(lines)


def extrapolated_table(name: str, groups, dps, bucket: int) -> str:
    n = sum(map(sum, groups))
    head = " | ".join(f"ZeRO-{s} {LABEL[o]}" for s, o in COMBOS)
    lines = [(f"{name} ({n:,} parameters), closed forms, state+gradients+master bytes per parameter per rank "
              f"(fp32 training; add 4 B/param of replicated fp32 weights for the total):"), "",
             f"| DP | {head} | 8-bit saves, ZeRO-1 | 8-bit saves, ZeRO-2 | 8-bit saves, ZeRO-3 |",
             "|---:|" + "---:|" * (len(COMBOS) + 3)]
    for dp in dps:
        t = {(s, o): total(bytes_per_rank(groups, dp, s, o, bucket)) / n for s, o in COMBOS}
        saves = [100 * (1 - t[(s, "bnb8")] / t[(s, "torch_adamw")]) for s in (1, 2, 3)]
        lines.append(f"| {dp} | " + " | ".join(f"{t[c]:.3f}" for c in COMBOS)
                     + "".join(f" | {x:.1f}%" for x in saves) + " |")
    return "\n".join(lines)


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    runs = measure(args)
    rows = rows_measured(runs, args.bucket)
    groups = runs[args.dp[0]]["results"][0]["group_numels"]
    text = "\n\n".join([
        measured_table(rows),
        extrapolated_table("Measured model", groups, args.extrapolate, args.bucket),
        extrapolated_table("Llama-2 7B shapes (reduce_bucket_size 5e8)", llama_shapes(), args.extrapolate,
                           DS_DEFAULT_BUCKET),
    ]) + "\n"
    print(text)
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump({"bucket": args.bucket, "rows": rows, "wall_s": {dp: r["wall_s"] for dp, r in runs.items()}}, f,
                  indent=1)


if __name__ == "__main__":
    main()
