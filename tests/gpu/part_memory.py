"""GPU proof, part m: peak memory per configuration from fresh processes, and the largest GPT each fits in 80 GB.

Each configuration of part f (ZeRO-2, bf16) trains three steps of the 125M and the 1B GPT in a process of its own
(engines built one after another in one process leave memory behind after destroy(), so a shared process would make
the peaks depend on the order). Measured per run: torch.cuda.max_memory_allocated and the bytes each role holds
(benchmarks/tensor_census.py: model weights, gradients, master weights, optimizer state).
The closed form of a configuration's peak: P x (its static bytes per parameter, from the census) + its activation
and workspace bytes, taken proportional to tokens x width x depth (the GPT's activations per layer scale with them at
a fixed context); the one coefficient is read at 125M, and the form must predict the 1B peak within 5% (a check).
With it, the table gives the largest GPT of the GPT-3 family of shapes (context 512, micro batch 8) that fits in
80 GB (an H100's) for each configuration. On the CPU rehearsal the sizes are stand-ins and the peaks are not measured
(the form is printed from the census alone, as notes).
"""

import json
import os
import subprocess
import sys

import proof_common as common
from part_speed import BF16_MASTER, COMPENSATED, FUSED, MICRO_BATCH, MODELS, TORCH_FUSED

LABELS = (FUSED, BF16_MASTER, COMPENSATED, "stock DeepSpeed, bnb AdamW8bit client", TORCH_FUSED,
          "DeepSpeed FusedAdam", "DeepSpeed bf16 master + bf16 states")
REHEARSED = (FUSED, COMPENSATED, TORCH_FUSED)  # the CPU rehearsal's (the same path, fewer processes)
STEPS = 3
TOLERANCE = 0.05  # the closed form against the 1B peak
CAPACITY = 80 * 10 ** 9  # bytes of an 80 GB GPU
VOCAB = 256
# GPT-3 paper, Table 2.1: (width, depth) of its model family, heads of 128 dimensions
FAMILY = ((768, 12), (1024, 24), (1536, 24), (2048, 24), (2560, 32), (4096, 32), (5120, 40), (8192, 48),
          (10240, 64), (12288, 96))


def gpt_params(width: int, depth: int, context: int) -> int:
    """Parameters of deepspeed_bnb/demo/gpt.py's GPT: blocks (12 w^2 + 13 w each), embeddings, final norm, head."""
    return depth * (12 * width * width + 13 * width) + VOCAB * width + context * width + 2 * width + width * VOCAB


def child(args, result):
    """One configuration at one size in this (fresh) process: its peak and its census."""
    import torch

    import part_speed
    from tensor_census import census
    common.one_rank(args.device)
    import deepspeed_bnb  # noqa: F401
    config = part_speed.configurations(2, False)[args.config]
    model_args = MODELS[args.device][args.size]
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine, model, tokens, targets, params = part_speed.build(config, 2, False, model_args, args.device)
    for _ in range(STEPS):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
    roles = census(engine)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    result.data["measured"] = {"params": params, "peak": peak, "roles": roles, "model": model_args}
    result.check(f"m: {args.config} at {args.size} trained {STEPS} steps", float(loss) == float(loss),
                 f"loss {float(loss):.3f}", "finite")


def run_children(args) -> dict:
    """(label, size) -> what its fresh process measured (or its error)."""
    found = {}
    for size in MODELS[args.device]:
        for label in labels(args.device):
            path = os.path.join(args.work, f"memory_{len(found)}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--result", path,
                   "--work", args.work, "--bundle", args.bundle, "--config", label, "--size", size]
            done = subprocess.run(cmd, timeout=args.child_timeout, check=False, capture_output=True, text=True)
            sys.stdout.write(done.stdout[-2000:] + done.stderr[-2000:])
            if os.path.isfile(path):
                with open(path) as f:
                    data = json.load(f)
                found[label, size] = data.get("measured") or {"error": (data.get("error") or "no measurement")[-300:]}
            else:
                found[label, size] = {"error": f"exit code {done.returncode}"}
    return found


def labels(device: str):
    return LABELS if device == "cuda" else REHEARSED


def tokens_times_layers(measured: dict, device: str) -> int:
    """Tokens x width x depth of a run: what its activations scale with at a fixed context."""
    model = measured["model"]
    return MICRO_BATCH[device] * model["context"] * model["width"] * model["depth"]


def static_bytes(measured: dict) -> int:
    return sum(measured["roles"].values())


def body(args, result):
    if args.config:
        child(args, result)
        return
    found = run_children(args)
    small, large = list(MODELS[args.device])
    rows, fits = [], []
    for label in labels(args.device):
        a, b = found[label, small], found[label, large]
        if "error" in a or "error" in b:
            result.check(f"m: {label}: both sizes ran", False, a.get("error") or b.get("error"), "ran")
            continue
        per_param = static_bytes(a) / a["params"]
        if a["peak"] is None:  # the CPU rehearsal: no device peak to calibrate the form with
            result.note(f"m: {label}: {per_param:.2f} static bytes per parameter at the stand-in's {a['params']:,}")
            continue
        # activation and workspace bytes per token-width-layer, read at the smaller size
        coefficient = (a["peak"] - static_bytes(a)) / tokens_times_layers(a, args.device)
        predicted = per_param * b["params"] + coefficient * tokens_times_layers(b, args.device)
        error = abs(predicted - b["peak"]) / b["peak"]
        result.check(f"m: {label}: the closed form read at {small} predicts the {large} peak", error <= TOLERANCE,
                     f"{predicted / 2 ** 30:.2f} GiB predicted, {b['peak'] / 2 ** 30:.2f} GiB measured "
                     f"({error:.1%})", f"within {TOLERANCE:.0%}")
        rows.append([label, f"{per_param:.2f}", f"{coefficient:.1f}", f"{a['peak'] / 2 ** 30:.2f}",
                     f"{b['peak'] / 2 ** 30:.2f}", f"{predicted / 2 ** 30:.2f}", f"{error:.1%}"])
        largest = None
        for width, depth in FAMILY:
            context = 512
            params = gpt_params(width, depth, context)
            peak = per_param * params + coefficient * MICRO_BATCH[args.device] * context * width * depth
            if peak <= CAPACITY:
                largest = (width, depth, params, peak)
        fits.append([label] + (["none"] * 3 if largest is None else
                               [f"{largest[2] / 1e9:.2f}B", f"width {largest[0]}, depth {largest[1]}",
                                f"{largest[3] / 1e9:.1f} GB"]))
    if rows:
        result.table(f"m: peak memory of each configuration in a fresh process (ZeRO-2, bf16, {STEPS} steps), and its "
                     f"closed form (static bytes per parameter from the census; activations per token x width x "
                     f"layer read at {small})",
                     ["configuration", "static B/param", "activation B per token-width-layer", f"{small} peak GiB",
                      f"{large} peak GiB", f"{large} predicted GiB", "error"], rows)
        result.table("m: the largest GPT-3-family model (context 512, micro batch 8) each configuration trains on one "
                     "80 GB GPU, by the closed form", ["configuration", "parameters", "shape", "predicted peak"],
                     fits)
    else:
        result.check("m: every configuration's fresh process measured its census", all("error" not in v for v in
                     found.values()), f"{sum('error' not in v for v in found.values())} of {len(found)}", "all")


def extra(parser):
    parser.add_argument("--config", help="measure this configuration in this process")
    parser.add_argument("--size", help="with --config: the model size")
    parser.add_argument("--child-timeout", type=float, default=120)


if __name__ == "__main__":
    common.run_part("m", "peak memory from fresh processes, and the largest GPT on 80 GB", body, extra)
