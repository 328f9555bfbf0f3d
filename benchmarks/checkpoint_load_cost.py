"""What safe loading costs: engine.load_checkpoint through the safe loader against full pickle, and where the time goes.

One CPU rank (gloo), AdamW8bit under ZeRO-2, for the demo GPT (`make demo`'s model) and a ~100M-parameter synthetic
MLP. Each checkpoint is saved once, then loaded back into the same engine `--repeats` times per mode, modes
interleaved so that page cache and machine load hit them alike:
- safe: the default (torch's weights-only unpickler + allow-list; every file's SHA-256 checked against the manifest,
  every file parsed by the safe loader first, as `engine.load_checkpoint` does);
- full pickle: the same load with DEEPSPEED_BNB_TRUST_CHECKPOINTS=1 (what torch.load(weights_only=False) costs,
  the path every load took before format 2).
Components, timed alone: SHA-256 of every file; parsing every file with each unpickler (memory-mapped).

    python benchmarks/checkpoint_load_cost.py [--repeats 5] [--skip-100m]
"""

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def one_rank():
    import deepspeed
    from launch import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def demo_model():
    from gpt import GPT, GPTConfig
    return GPT(GPTConfig(width=128, depth=4, heads=4))


def synthetic_model(width=4096, layers=6):
    """~100M parameters: `layers` square Linear layers of `width` (6 x 4096^2 + biases = 100.7M)."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def engine_for(model):
    import bitsandbytes as bnb
    import deepspeed
    import deepspeed_bnb  # noqa: F401
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def step_once(engine):
    """One optimizer step with a gradient of ones (enough to create every state tensor)."""
    for p in engine.module.parameters():
        p.grad = None
    loss = sum(p.float().sum() for p in engine.module.parameters()) * 1e-6
    engine.backward(loss)
    engine.step()


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def tag_files(folder):
    tag_dir = os.path.join(folder, "t")
    return [os.path.join(tag_dir, n) for n in sorted(os.listdir(tag_dir)) if n.endswith(".pt")]


def sha_all(paths):
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)


def measure(name, model, repeats, root):
    from deepspeed_bnb.checkpoint.safe_load import TRUST_ENV, load_file
    numel = sum(p.numel() for p in model.parameters())
    engine = engine_for(model)
    step_once(engine)
    folder = os.path.join(root, name)
    save_s = timed(lambda: engine.save_checkpoint(folder, tag="t"))
    paths = tag_files(folder)
    size = sum(os.path.getsize(p) for p in paths)
    times = {"safe": [], "full pickle": [], "sha256": [], "parse safe": [], "parse full": []}
    for _ in range(repeats):
        os.environ.pop(TRUST_ENV, None)
        times["safe"].append(timed(lambda: engine.load_checkpoint(folder, tag="t")))
        os.environ[TRUST_ENV] = "1"
        times["full pickle"].append(timed(lambda: engine.load_checkpoint(folder, tag="t")))
        times["parse full"].append(timed(lambda: [load_file(p, mmap=True) for p in paths]))
        os.environ.pop(TRUST_ENV, None)
        times["parse safe"].append(timed(lambda: [load_file(p, mmap=True) for p in paths]))
        times["sha256"].append(timed(lambda: sha_all(paths)))
    return name, numel, size, save_s, {k: statistics.median(v) for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-100m", action="store_true", help="only the demo model")
    args = parser.parse_args()
    import warnings
    warnings.filterwarnings("ignore", message=".*loaded with full pickle.*")
    one_rank()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        rows.append(measure("demo GPT", demo_model(), args.repeats, root))
        if not args.skip_100m:
            rows.append(measure("synthetic 100M", synthetic_model(), args.repeats, root))
    print(f"\nengine.load_checkpoint, one CPU rank, AdamW8bit ZeRO-2, median of {args.repeats} "
          f"(torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| model | params | checkpoint | save | load safe | load full pickle | safe / full | SHA-256 all files "
          "| parse safe | parse full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, numel, size, save_s, t in rows:
        print(f"| {name} | {numel / 1e6:.1f}M | {size / 2 ** 20:.0f} MiB | {save_s:.2f} s | {t['safe']:.3f} s | "
              f"{t['full pickle']:.3f} s | {t['safe'] / t['full pickle']:.2f}x | {t['sha256']:.3f} s | "
              f"{t['parse safe']:.3f} s | {t['parse full']:.3f} s |")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # gloo's C++ teardown can abort after the table is printed
