"""One configuration of benchmarks/nvme_offload.py, on the ranks torchrun started: train an MLP under ZeRO-3 with the
optimizer offloaded to NVMe, counting the bytes every async_io handle of the process reads and writes.

The count: DeepSpeed's swappers and deepspeed_bnb's build their handles through `AsyncIOBuilder().load().aio_handle`;
before any engine exists, `load` is wrapped to hand out handles whose transfer methods add up each buffer's bytes and
pass the call on. So both stacks are measured the same way, at the point the bytes go to the file system (the
kernel's /proc/<pid>/io does not see libaio's transfers, and the page cache hides reads).
"""

import argparse
import json
import os
import resource
import time

import torch

COUNTS = {"read": 0, "written": 0}
READS, WRITES = ("async_pread", "sync_pread", "pread", "read"), ("async_pwrite", "sync_pwrite", "pwrite", "write")


class CountingHandle:
    """An async_io handle that counts the bytes of every transfer it is given."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name):
        method = getattr(self._handle, name)
        if name not in READS + WRITES:
            return method

        def counted(buffer, *args, **kwargs):
            COUNTS["read" if name in READS else "written"] += buffer.numel() * buffer.element_size()
            return method(buffer, *args, **kwargs)
        return counted


def count_aio() -> None:
    from deepspeed.ops.op_builder import AsyncIOBuilder
    load = AsyncIOBuilder.load

    class Module:
        def __init__(self, module):
            self._module = module

        def __getattr__(self, name):
            return getattr(self._module, name)

        def aio_handle(self, *args, **kwargs):
            return CountingHandle(self._module.aio_handle(*args, **kwargs))

    AsyncIOBuilder.load = lambda self, *args, **kwargs: Module(load(self, *args, **kwargs))


def model(hidden: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 16))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True, choices=("bnb8", "bnb8_bf16", "bnb8_bf16+8", "torch_adamw",
                                                       "ds_cpuadam"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3, help="steps not counted (the first ones create the swap files)")
    p.add_argument("--nvme", required=True)
    p.add_argument("--result", required=True)
    args = p.parse_args()
    count_aio()
    # DeepSpeed before 0.19.8 may find libaio missing later in the process (its has_function swallows the error once
    # setuptools replaced distutils): load the op first
    from deepspeed.ops.op_builder import AsyncIOBuilder
    AsyncIOBuilder().load(verbose=False)
    import bitsandbytes as bnb
    import deepspeed
    from deepspeed import comm as dist
    ours = args.config.startswith("bnb8")
    if ours:
        import deepspeed_bnb  # noqa: F401
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    net = model(args.hidden, args.depth)
    params = sum(p.numel() for p in net.parameters())
    config = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme},
                                    "stage3_param_persistence_threshold": 0},
              "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}}
    if ours:  # bnb8: fp32 master weights; bnb8_bf16, bnb8_bf16+8: bf16 and compensated ones
        config["zero_optimization"]["bnb_master_weights"] = args.config.partition("_")[2] or "fp32"
    if args.config == "ds_cpuadam":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
        engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    else:
        config["zero_force_ds_cpu_optimizer"] = False
        optimizer = (bnb.optim.AdamW8bit(net.parameters(), lr=1e-3, weight_decay=0.0) if ours
                     else torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0))
        engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    times, losses = [], []
    for step in range(args.steps):
        if step == args.skip:
            counted = dict(COUNTS)
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, args.hidden, generator=g).to(torch.bfloat16)
        y = torch.randint(0, 16, (4,), generator=g)
        started = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
    measured = args.steps - args.skip
    swap_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(args.nvme) for f in files
                     if f"rank{rank}" in root)
    mine = {"read_per_step": (COUNTS["read"] - counted["read"]) / measured,
            "written_per_step": (COUNTS["written"] - counted["written"]) / measured,
            "step_s": sorted(times[args.skip:])[measured // 2], "swap_file_bytes": swap_bytes,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
            "zero": type(engine.optimizer).__name__, "losses": losses}
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"params": params, "world": world, "ranks": everyone}, f, indent=1)


if __name__ == "__main__":
    main()
    # imported only now: importing it imports deepspeed_bnb, which the stock configurations must run without
    from deepspeed_bnb.utils.teardown import finish
    finish()
