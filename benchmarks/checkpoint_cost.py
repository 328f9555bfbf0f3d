"""What checkpoints cost: save time and size, 8-bit against 32-bit AdamW, and load time through the safe loader
against full pickle.

One CPU rank (gloo), ZeRO-2, for the demo GPT (`make demo`'s model) and a ~100M-parameter synthetic MLP:
- AdamW8bit (deepspeed_bnb): save (DeepSpeed's files, then per-file SHA-256 and per-tensor CRC-32, the safe-loader
  check and the atomic publish), size, and load, safe (the default: torch's weights-only unpickler + allow-list,
  every file's SHA-256 checked, every file parsed first) against full pickle (DEEPSPEED_BNB_TRUST_CHECKPOINTS=1, the
  path every load took before format 2);
- torch.optim.AdamW (32-bit) under stock DeepSpeed: save and size (the baseline a user compares against), and load.
Each checkpoint is saved `--repeats` times (fresh tags) and loaded back into the same engine as often, modes
interleaved so that page cache and machine load hit them alike; medians. Components, timed alone: SHA-256 of every
file; parsing every file with each unpickler (memory-mapped).

    python benchmarks/checkpoint_cost.py [--repeats 3] [--skip-100m]
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
sys.path.insert(0, HERE)
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def one_rank():
    import deepspeed
    from launch import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def demo_model():
    from deepspeed_bnb.demo.gpt import GPT, GPTConfig
    return GPT(GPTConfig(width=128, depth=4, heads=4))


def synthetic_model(width=4096, layers=6):
    """~100M parameters: `layers` square Linear layers of `width` (6 x 4096^2 + biases = 100.7M)."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def engine_for(model, eight_bit: bool):
    import bitsandbytes as bnb
    import deepspeed
    import deepspeed_bnb  # noqa: F401
    from deepspeed_bnb.runtime.engine import stock_deepspeed
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
    if eight_bit:
        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    with stock_deepspeed():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


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


def tag_files(folder, tag="t"):
    tag_dir = os.path.join(folder, tag)
    return [os.path.join(tag_dir, n) for n in sorted(os.listdir(tag_dir)) if n.endswith(".pt")]


def sha_all(paths):
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                digest.update(chunk)


def measure(name, make_model, repeats, root):
    """Rows (model, optimizer, params, size, save, load safe, load full, sha, parse safe, parse full) for one model."""
    from deepspeed_bnb.checkpoint.format.safe_load import TRUST_ENV, load_file
    rows = []
    for eight_bit in (True, False):
        model = make_model()
        numel = sum(p.numel() for p in model.parameters())
        engine = engine_for(model, eight_bit)
        step_once(engine)
        folder = os.path.join(root, f"{name}-{eight_bit}")
        saves = [timed(lambda i=i: engine.save_checkpoint(folder, tag=f"t{i}")) for i in range(repeats)]
        paths = tag_files(folder, "t0")
        size = sum(os.path.getsize(p) for p in paths)
        times = {"safe": [], "full pickle": [], "sha256": [], "parse safe": [], "parse full": []}
        for _ in range(repeats):
            os.environ.pop(TRUST_ENV, None)
            times["safe"].append(timed(lambda: engine.load_checkpoint(folder, tag="t0")))
            os.environ[TRUST_ENV] = "1"
            if eight_bit:  # stock DeepSpeed has one path: full pickle
                times["full pickle"].append(timed(lambda: engine.load_checkpoint(folder, tag="t0")))
            times["parse full"].append(timed(lambda: [load_file(p, mmap=True) for p in paths]))
            os.environ.pop(TRUST_ENV, None)
            if eight_bit:
                times["parse safe"].append(timed(lambda: [load_file(p, mmap=True) for p in paths]))
            times["sha256"].append(timed(lambda: sha_all(paths)))
        median = {k: statistics.median(v) if v else None for k, v in times.items()}
        if not eight_bit:  # what stock loads with
            median["full pickle"], median["safe"] = median["safe"], None
        rows.append((name, "AdamW8bit (deepspeed_bnb)" if eight_bit else "torch AdamW (stock ZeRO)", numel, size,
                     statistics.median(saves), median))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-100m", action="store_true", help="only the demo model")
    args = parser.parse_args()
    import warnings
    warnings.filterwarnings("ignore", message=".*loaded with full pickle.*")
    one_rank()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        rows += measure("demo GPT", demo_model, args.repeats, root)
        if not args.skip_100m:
            rows += measure("synthetic 100M", synthetic_model, args.repeats, root)
    fmt = lambda v: "-" if v is None else f"{v:.3f} s"  # noqa: E731
    print(f"\nOne CPU rank, ZeRO-2, median of {args.repeats} (torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| model | optimizer | params | checkpoint | save | load safe | load full pickle | SHA-256 all files "
          "| parse safe | parse full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, optimizer, numel, size, save_s, t in rows:
        print(f"| {name} | {optimizer} | {numel / 1e6:.1f}M | {size / 2 ** 20:.0f} MiB | {save_s:.2f} s | "
              f"{fmt(t['safe'])} | {fmt(t['full pickle'])} | {fmt(t['sha256'])} | {fmt(t['parse safe'])} | "
              f"{fmt(t['parse full'])} |")


if __name__ == "__main__":
    main()
    from deepspeed_bnb.utils.teardown import release_shm_buffer
    release_shm_buffer(0)  # DeepSpeed's CPU comm op leaves its buffer in /dev/shm otherwise
    sys.stdout.flush()
    os._exit(0)  # gloo's C++ teardown can abort after the table is printed
