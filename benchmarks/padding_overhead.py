"""Padding cost of the block-aligned layouts: ZeRO-1/2 (every parameter starts on a 256-element block, groups pad to
256 * dp) and ZeRO-3 (every parameter padded to 256 * dp, so each rank's slice is whole blocks).

Pure arithmetic on real model shapes (no weights are built): prints, per model, stage and DP size, the padding
elements and their share of the parameters, beside stock ZeRO-3's own padding (each parameter to a multiple of dp).
Usage: python benchmarks/padding_overhead.py [--dp 1 8 64 1024]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepspeed_bnb.state_layout import GroupLayout, ShardedLayout  # noqa: E402


def gpt2_shapes(layers=12, width=768, vocab=50257, context=1024):
    """GPT-2 small (124M) as HF builds it, split AdamW-style into decay (matrices) and no-decay (vectors) groups."""
    decay, other = [vocab * width, context * width], []
    for _ in range(layers):
        decay += [width * 3 * width, width * width, width * 4 * width, 4 * width * width]
        other += [width, width, 3 * width, width, width, width, 4 * width, width]
    return [decay, other + [width, width]]


def llama_shapes(layers=32, width=4096, hidden=11008, vocab=32000):
    """Llama-2-7B: no biases; RMSNorm weights in the no-decay group."""
    decay = [vocab * width, vocab * width] + [width * width] * 4 * layers + [width * hidden] * 3 * layers
    return [decay, [width] * (2 * layers + 1)]


def demo_shapes(width=128, depth=4, vocab=256, context=128):
    """deepspeed_bnb/demo/gpt.py defaults."""
    decay, other = [vocab * width, context * width, vocab * width], [width, width]
    for _ in range(depth):
        decay += [width * 3 * width, width * width, width * 4 * width, 4 * width * width]
        other += [width, width, 3 * width, width, width, width, 4 * width, width]
    return [decay, other]


MODELS = {"demo GPT (deepspeed_bnb/demo/gpt.py)": demo_shapes(), "GPT-2 124M": gpt2_shapes(),
          "Llama-2 7B": llama_shapes()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2, 8, 64, 1024], help="data-parallel sizes")
    args = parser.parse_args()
    print("| model | parameters | tensors | ZeRO stage | DP | padding elements | padding / parameters | "
          "stock ZeRO-3 padding |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name, groups in MODELS.items():
        params = sum(map(sum, groups))
        tensors = sum(map(len, groups))
        for stage, layout in (("1/2", GroupLayout), ("3", ShardedLayout)):
            for dp in args.dp:
                padding = sum(layout(tuple(g), dp).padding_numel for g in groups)
                stock_padding = sum(ShardedLayout(tuple(g), dp, block=1).padding_numel for g in groups)
                stock = f"{100 * stock_padding / params:.4f}%" if stage == "3" else ""
                print(f"| {name} | {params:,} | {tensors} | {stage} | {dp} | {padding:,} | "
                      f"{100 * padding / params:.4f}% | {stock} |")


if __name__ == "__main__":
    main()
