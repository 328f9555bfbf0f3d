"""What the padding-tensor path (DeepSpeed releases before 0.19.7) costs against DeepSpeed's per-parameter padding
(0.19.7 on): both built side by side on the installed DeepSpeed (which must have both), the same GPT, the same data.

Prints, per model, ZeRO stage and DP size: the padding share (the same by construction: one layout, so the flat
buffers are compared), the tensors DeepSpeed walks in its flat lists, and the median backward (where ZeRO-2
partitions gradients) and engine.step() times of each path, stepped in turns in one process, with their ratio.
Weights after the run are compared too (the two paths compute the same thing).
Usage: python benchmarks/padding_paths.py [--quick]
"""

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launch import torchrun  # noqa: E402

MODELS = {"demo GPT (0.9M)": ["--width", "128", "--depth", "4"],
          "GPT w520 d8 (27M)": ["--width", "520", "--depth", "8"]}  # widths off the 256 grid: every norm is padded


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the demo model only, 8 steps")
    args = p.parse_args()
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    steps = "8" if args.quick else "30"
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for label, model in models.items():
            for stage in (1, 2):
                for world in (1, 2):
                    path = os.path.join(out, f"{len(rows)}.json")
                    torchrun(os.path.join(HERE, "padding_paths_worker.py"), world,
                             ["--result", path, "--stage", str(stage), "--steps", steps, *model])
                    with open(path) as f:
                        rows.append((label, json.load(f)))
    print(f"DeepSpeed {rows[0][1]['deepspeed']}: per-parameter padding (param_padding) against padding tensors "
          f"(tensors), medians of {steps} steps each, stepped in turns\n")
    print("| model | ZeRO | DP | padding | same flat buffers, same weights after | tensors in flat lists | "
          "backward ms (param_padding / tensors) | step ms (param_padding / tensors) | step ratio |")
    print("|---|---:|---:|---:|---|---|---|---|---:|")
    for label, r in rows:
        ms, n = r["median_ms"], r["tensors_in_flat_lists"]
        ratio = ms["tensors"]["step"] / ms["param_padding"]["step"]
        print(f"| {label} | {r['stage']} | {r['world']} | {r['padding_pct']:.3f}% | "
              f"{'yes' if r['same_flat_buffers'] and r['same_weights_after'] else 'NO'} | "
              f"{n['param_padding']} / {n['tensors']} | "
              f"{ms['param_padding']['backward']:.1f} / {ms['tensors']['backward']:.1f} | "
              f"{ms['param_padding']['step']:.1f} / {ms['tensors']['step']:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
