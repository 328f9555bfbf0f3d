"""Tables (markdown) and plots (PNG) of compare_adam.py's measurements; ratios are taken against 32-bit torch AdamW."""

import os
import platform
import statistics
import subprocess
import textwrap
from importlib import metadata

from compare_adam_configs import LABELS, REFERENCE

MB = 2 ** 20


def environment() -> dict:
    """The machine and the versions, as benchmarks/README.md reports them."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
                   "?")
    except OSError:
        cpu = platform.processor() or "?"
    versions = {name: metadata.version(name) for name in ("torch", "deepspeed", "bitsandbytes")}
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), **versions}


def final_loss(r: dict) -> float:
    """Mean training loss over the last tenth of the steps (at least 5): one step's loss is too noisy to compare."""
    tail = max(5, len(r["losses"]) // 10)
    return statistics.mean(r["losses"][-tail:])


def summarize(r: dict) -> dict:
    ranks = r["per_rank"]
    state = [x["state_bytes"] for x in ranks]
    return {
        "state_per_rank": max(state),
        "state_per_param": sum(state) / r["n_params"],  # all ranks' state over the model's parameters
        "rss_peak": max(x["rss_peak_train"] for x in ranks),
        "rss_start": max(x["rss_at_start"] for x in ranks),
        "step_ms": 1000 * r["median_step_s"],
        "engine_step_ms": 1000 * r["median_engine_step_s"],
        "tokens_per_s": r["tokens_per_s"],
        "ckpt_optim": r["ckpt_optim"],
        "ckpt_optim_state": r["ckpt_optim"] - r["ckpt_optim_master"],  # the file part that is not master weights
        "ckpt_total": r["ckpt_total"],
        "final_loss": final_loss(r),
        "valid_loss": r["valid_loss"],
        **update_sizes(r),
    }


def update_sizes(r: dict) -> dict:
    """The largest |update| / lr of any element in one step over the run, its median over steps, and how often an
    element moved beyond 10 x lr (steps, elements)."""
    per_step = [x for x in r.get("update_over_lr", []) if x is not None]
    beyond = r.get("updates_beyond_10_lr", [])
    if not per_step:
        return {"update_max": float("nan"), "update_median": float("nan"), "spike_steps": 0, "spike_elements": 0}
    return {"update_max": max(per_step), "update_median": statistics.median(per_step),
            "spike_steps": sum(1 for n in beyond if n), "spike_elements": sum(beyond)}


def _ratio(a, b) -> str:
    return f"{a / b:.3f}x"


def _pct(a, b) -> str:
    return f"{100 * (a - b) / b:+.2f}%"


def tables(results: dict, meta: dict) -> str:
    s = {name: summarize(r) for name, r in results.items()}
    any_r = next(iter(results.values()))
    p, env = meta["preset"], meta.get("environment", {})
    tail = max(5, p["steps"] // 10)
    zero = f"ZeRO-{meta.get('stage', 2)}" + (" with offload_optimizer (state in host memory)" if meta.get("offload")
                                             else "")
    lines = [
        (f"Model: GPT width {p['width']}, depth {p['depth']}, context {p['context']} ({any_r['n_params']:,} "
        f"parameters); {zero}, {'bf16' if meta.get('bf16') else 'fp32'}, {meta['nproc']} CPU ranks, micro-batch "
        f"{p['batch']} per rank, {p['steps']} steps, WarmupLR to {p.get('lr', 3e-3):g} over {p['warmup_lr_steps']} "
        f"steps, betas (0.9, 0.95), weight decay 0.1 "
        f"(matrices), clipping 1.0, seed {meta['seed']}. Step time: median after {p['timing_skip']} warm-up "
        f"steps. Final loss: mean of the last {tail} steps (averaged over ranks). Validation: {p['valid_batches']} "
        f"fixed held-out batches per rank."),
        "",
        (f"Machine: {env.get('cpu', '?')}, {env.get('cores', '?')} cores; Python {env.get('python', '?')}, torch "
        f"{env.get('torch', '?')}, deepspeed {env.get('deepspeed', '?')}, bitsandbytes {env.get('bitsandbytes', '?')}."
        f" Command: `{meta['command']}` ({meta['total_wall_s']:.0f} s). 1-minute load average when each job "
        f"started (2 = both cores busy): "
        + ", ".join(f"{LABELS[n]} {r.get('load_avg_1min_at_start', float('nan')):.1f}" for n, r in results.items())
        + "."),
        "",
        "| configuration | ZeRO optimizer | base optimizer | update path |",
        "|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {LABELS[name]} | `{r['zero_optimizer'].rsplit('.', 1)[-1]}` | `{r['base_optimizer']}` | "
                     f"{r['update_path']} |")
    lines += ["", ("| configuration | state / rank | state B/param | peak RSS / rank (after imports) | step | "
                   "of which engine.step() | tokens/s | ckpt optimizer files | ckpt total | final train loss | "
                   "valid loss |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, x in s.items():
        lines.append(f"| {LABELS[name]} | {x['state_per_rank'] / MB:.3f} MB | {x['state_per_param']:.3f} | "
                     f"{x['rss_peak'] / MB:.0f} MB ({x['rss_start'] / MB:.0f} MB) | {x['step_ms']:.0f} ms | "
                     f"{x['engine_step_ms']:.1f} ms | "
                     f"{x['tokens_per_s']:,.0f} | {x['ckpt_optim'] / MB:.3f} MB | {x['ckpt_total'] / MB:.3f} MB | "
                     f"{x['final_loss']:.4f} | {x['valid_loss']:.4f} |")
    if REFERENCE in s:
        ref = s[REFERENCE]
        lines += ["", f"Against {LABELS[REFERENCE]} (same run):", "",
                  ("| configuration | state | ckpt optimizer files | … without master weights | ckpt total | "
                  "peak RSS | step time | engine.step() time | final train loss | valid loss |"),
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, x in s.items():
            lines.append(f"| {LABELS[name]} | {_ratio(x['state_per_rank'], ref['state_per_rank'])} | "
                         f"{_ratio(x['ckpt_optim'], ref['ckpt_optim'])} | "
                         f"{_ratio(x['ckpt_optim_state'], ref['ckpt_optim_state'])} | "
                         f"{_ratio(x['ckpt_total'], ref['ckpt_total'])} | {_ratio(x['rss_peak'], ref['rss_peak'])} | "
                         f"{_ratio(x['step_ms'], ref['step_ms'])} | "
                         f"{_ratio(x['engine_step_ms'], ref['engine_step_ms'])} | "
                         f"{_pct(x['final_loss'], ref['final_loss'])} | "
                         f"{_pct(x['valid_loss'], ref['valid_loss'])} |")
    if all("census_peak" in r["per_rank"][0] for r in results.values()):
        lines += ["", *master_table(results, s)]
    lines += ["", ("Update size: the largest |w_new - w_old| / lr of any master weight in one step (Adam moves an "
                   "element by about lr at most; far more is a spike), its median over the steps, and how many steps "
                   "moved some element beyond 10 x lr:"), "",
              "| configuration | largest / lr | median per step | steps beyond 10 x lr | elements beyond 10 x lr |",
              "|---|---:|---:|---:|---:|"]
    for name, x in s.items():
        lines.append(f"| {LABELS[name]} | {x['update_max']:.2f} | {x['update_median']:.2f} | {x['spike_steps']} | "
                     f"{x['spike_elements']} |")
    lines += ["", ("Optimizer state per rank, from the state tensors (elements: the master partition this rank "
                  "updates, alignment padding included):"), "",
              "| configuration | rank | elements | state bytes | bytes / element | by key |",
              "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        for rank, x in enumerate(r["per_rank"]):
            keys = ", ".join(f"{k} {v:,}" for k, v in x["state_bytes_by_key"].items())
            lines.append(f"| {LABELS[name]} | {rank} | {x['master_numel']:,} | {x['state_bytes']:,} | "
                         f"{x['state_bytes'] / x['master_numel']:.3f} | {keys} |")
    return "\n".join(lines) + "\n"


LEAST = "ds_bf16_states"  # DeepSpeed's own least-memory setting, which the master-weight table compares with
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}  # DeepSpeed's master dtype, named as deepspeed_bnb's modes


def master_table(results: dict, s: dict) -> list:
    """Bytes per parameter by role (all ranks' bytes over the model's parameters; gradients at their sampled peak)
    from the live tensors (tensor_census.py), with loss and step time, against fp32 master weights and states."""
    def per_param(r, role):
        return sum(x["census_peak"][role] for x in r["per_rank"]) / r["n_params"]

    rows = {name: {"master": per_param(r, "master"), "state": per_param(r, "state"),
                   "gradients": per_param(r, "gradients")} for name, r in results.items()}
    ref = s.get(REFERENCE)
    lines = [("Bytes per parameter, all ranks together (tensor_census.py: the live tensors, gradients at their sampled "
              "peak), with the loss each configuration reached:"), "",
             ("| configuration | master weights | master B/param | state B/param | master + state | vs DeepSpeed bf16 "
              "states | gradients B/param (peak) | peak RSS / rank | engine.step() | final train loss | valid loss | "
              "valid vs fp32 AdamW |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    least = rows.get(LEAST)
    for name, r in results.items():
        x, row = s[name], rows[name]
        both = row["master"] + row["state"]
        lines.append(
            f"| {LABELS[name]} | {DTYPE_NAMES.get(r.get('master_weights'), r.get('master_weights'))} | "
            f"{row['master']:.2f} | {row['state']:.2f} | "
            f"{both:.2f} | {_ratio(both, least['master'] + least['state']) if least else 'n/a'} | "
            f"{row['gradients']:.2f} | {x['rss_peak'] / MB:.0f} MB | {x['engine_step_ms']:.1f} ms | "
            f"{x['final_loss']:.4f} | {x['valid_loss']:.4f} | "
            f"{_pct(x['valid_loss'], ref['valid_loss']) if ref else 'n/a'} |")
    return lines


def plot_loss(results: dict, path: str, stage: int = 2) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    ref = results.get(REFERENCE)
    for name, r in results.items():
        steps = range(1, len(r["losses"]) + 1)
        top.plot(steps, r["losses"], label=LABELS[name], linewidth=1)
        if ref is not None:
            bottom.plot(steps, [a - b for a, b in zip(r["losses"], ref["losses"])], label=LABELS[name], linewidth=1)
    top.set_ylabel("training loss (nats/byte, mean over ranks)")
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_ylabel(f"loss - {LABELS[REFERENCE]}")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"Same model, data, seed and schedule; ZeRO-{stage} on CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_memory(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    s = {name: summarize(r) for name, r in results.items()}
    names = [textwrap.fill(LABELS[n], 13) for n in s]  # bars are narrow: wrap labels so neighbours do not touch
    panels = [
        ("optimizer state, bytes / parameter", [x["state_per_param"] for x in s.values()], None, None),
        ("peak RSS per rank, MB", [x["rss_start"] / MB for x in s.values()],
         [(x["rss_peak"] - x["rss_start"]) / MB for x in s.values()], ("after imports", "training")),
        ("checkpoint optimizer files, MB", [(x["ckpt_optim"] - x["ckpt_optim_state"]) / MB for x in s.values()],
         [x["ckpt_optim_state"] / MB for x in s.values()], ("master weights", "optimizer state + rest")),
        ("median step time, ms", [x["engine_step_ms"] for x in s.values()],
         [x["step_ms"] - x["engine_step_ms"] for x in s.values()], ("engine.step()", "forward + backward")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.5))
    for ax, (title, bottom, top, legend) in zip(axes, panels):
        bars = ax.bar(names, bottom, color="#4c72b0", label=legend[0] if legend else None)
        if top is not None:
            bars = ax.bar(names, top, bottom=bottom, color="#dd8452", label=legend[1])
            ax.legend(fontsize=8)
        totals = [b + (t if top is not None else 0) for b, t in zip(bottom, top or bottom)]
        for bar, value in zip(bars, totals):
            ax.annotate(f"{value:.2f}" if value < 10 else f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(results: dict, meta: dict, out: str) -> str:
    text = tables(results, meta)
    with open(os.path.join(out, "compare_adam.md"), "w") as f:
        f.write("# compare_adam results\n\n" + text + "\n![loss](loss.png)\n\n![memory](memory.png)\n")
    plot_loss(results, os.path.join(out, "loss.png"), meta.get("stage", 2))
    plot_memory(results, os.path.join(out, "memory.png"))
    return text
