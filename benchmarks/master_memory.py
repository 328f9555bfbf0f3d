"""Closed forms: bytes per parameter per rank of master weights and optimizer state, by master-weight mode.

The five configurations a memory-bound user of a bf16 model chooses between (compare_adam.py --bf16 measures them on
the demo GPT; this evaluates the same layout at Llama-2 7B and 70B shapes):
  fp32 AdamW                          master fp32 (4), Adam moments fp32 (8)
  DeepSpeed bf16 master + bf16 states master bf16 (2), moments bf16 (4)
  deepspeed_bnb, fp32 master          master fp32 (4), 8-bit moments (2 + 8/256 of per-block scales)
  deepspeed_bnb, bf16 master          master bf16 (2), 8-bit moments
  deepspeed_bnb, bf16+8 master        master bf16 + int8 error (3), 8-bit moments
Padding as scaling_model.py has it (deepspeed_bnb pads every tensor to 256-element blocks and the group to 256 * DP;
stock ZeRO pads a group to 2 * DP); tensors below bnb's min_8bit_size (4096) keep fp32 moments. For the demo GPT at
DP 2 these forms give what compare_adam.py --bf16 measures from the live tensors, to the second decimal (ZeRO-2:
6.10, 4.09, 5.10 B/param for ours; ZeRO-3: 6.13, 4.11, 5.12; the first table below). Gradients are left out: their
peak depends on DeepSpeed's bucketing (compare_adam.py measures it: 6.1 B/param with fp32 master weights, 4.1 with
bf16 ones, on the demo GPT). With offload_optimizer: cpu, master weights and state live in host memory instead;
DeepSpeed's own offloaded Adam is DeepSpeedCPUAdam, whose bf16 states need bf16 master weights (its
fp32_optimizer_states=False): the same bytes as the "DeepSpeed bf16" row.

    python benchmarks/master_memory.py            # prints the table (writes results/master_memory.md)
"""

import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from padding_overhead import demo_shapes, llama_shapes
from scaling_model import bytes_per_rank3, padded, padded3, state_bytes


@dataclass(frozen=True)
class Config:
    """One configuration's bytes per element of each role."""

    label: str  # as compare_adam.py names it
    optimizer: str  # "torch_adamw" or "bnb8" (scaling_model.py's layouts)
    master: float  # bytes per element of the master partition (bnb's error term included)
    moment: float  # bytes per moment element (fp32 or bf16 Adam; 8-bit handled by `optimizer`)


CONFIGS = (
    Config("fp32 AdamW", "torch_adamw", 4, 4),
    Config("DeepSpeed bf16 master + bf16 states", "torch_adamw", 2, 2),
    Config("deepspeed_bnb AdamW8bit, fp32 master", "bnb8", 4, 0),
    Config("deepspeed_bnb AdamW8bit, bf16 master", "bnb8", 2, 0),
    Config("deepspeed_bnb AdamW8bit, bf16+8 master", "bnb8", 3, 0),
)


def llama70b_shapes(layers=80, width=8192, hidden=28672, vocab=32000, kv=1024):
    """Llama-2-70B: grouped-query attention (8 key/value heads of 128), no biases."""
    decay = [vocab * width, vocab * width] + [width * width, width * kv, width * kv, width * width] * layers \
        + [width * hidden] * 3 * layers
    return [decay, [width] * (2 * layers + 1)]


def roles(groups, dp: int, stage: int, config: Config) -> dict:
    """Bytes per rank by role (master, state) for `groups` (element counts per param group)."""
    if stage == 3:
        elements = sum(padded3(n, dp, config.optimizer) for g in groups for n in g)
        state = bytes_per_rank3(groups, dp, config.optimizer, 0)["state"]
    else:
        elements = sum(padded(g, dp, config.optimizer) for g in groups)
        state = state_bytes(groups, dp, config.optimizer)
    if config.optimizer == "torch_adamw":
        state *= config.moment / 4  # scaling_model.py counts fp32 moments
    return {"master": config.master * elements / dp, "state": state}


def _size(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2 ** 20:.2f} MiB"


def table(name: str, groups, dps=(8, 64), stages=(2, 3)) -> str:
    n = sum(map(sum, groups))
    lines = [f"{name} ({n:,} parameters): bytes per model parameter, all ranks together (each rank holds "
             f"1/DP of them; padding included); \"vs DS bf16\": master + state against DeepSpeed's bf16 master + "
             f"bf16 states (offloaded: DeepSpeedCPUAdam with bf16 states, the same bytes in host memory).", "",
             "| ZeRO | DP | configuration | master | state | master + state | vs DS bf16 | "
             "master + state per rank (device; host with offload_optimizer) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for stage in stages:
        for dp in dps:
            ds = roles(groups, dp, stage, CONFIGS[1])
            for config in CONFIGS:
                r = roles(groups, dp, stage, config)
                both = r["master"] + r["state"]
                lines.append(f"| {stage} | {dp} | {config.label} | {r['master'] / n * dp:.2f} | "
                             f"{r['state'] / n * dp:.2f} | {both / n * dp:.2f} | "
                             f"{both / (ds['master'] + ds['state']):.3f}x | "
                             f"{_size(both)} |")
    return "\n".join(lines)


def main():
    text = "\n\n".join([table("Demo GPT (deepspeed_bnb/demo/gpt.py; measured by compare_adam.py --bf16 at DP 2)",
                               demo_shapes(), dps=(2,)),
                         table("Llama-2 7B", llama_shapes()), table("Llama-2 70B", llama70b_shapes())]) + "\n"
    print(text)
    out = os.path.join(HERE, "results", "master_memory.md")
    with open(out, "w") as f:
        f.write("# Master weights and state per rank, closed forms (benchmarks/master_memory.py)\n\n" + text)


if __name__ == "__main__":
    main()
