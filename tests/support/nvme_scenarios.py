"""NVMe offload scenarios (ZeRO-Infinity), run by tests/distributed/test_nvme.py under `torchrun --nproc_per_node 2`.

A bf16 MLP whose two large weights give each rank partitions of 1 MiB and more (DeepSpeed swaps nothing smaller:
`min_aio_bytes`), with bnb AdamW8bit under ZeRO-3. Each offload kind trains STEPS steps, saving after SAVE_AT:
- `cpu`: optimizer and parameters offloaded to the CPU (the reference);
- `param_nvme`: parameters swapped to NVMe (`offload_param.device: nvme`), optimizer on the CPU;
- `opt_nvme`: the optimizer on NVMe (`offload_optimizer.device: nvme`: fp32 partitions and gradients through
  DeepSpeed's swapper, bnb state through deepspeed_bnb's), parameters on the CPU;
- `both_nvme`: both on NVMe.
Sub-groups hold one large weight each (sub_group_size), so some are swapped and one (the small rest) is not.
Rank 0 writes, per kind: the losses, whether the final fp32 weights equal the reference's bit for bit, and how many
swap files each rank held and, between steps, whether every swapped sub-group's fp32 partition and bnb state were out
of memory (the controls: NVMe was used). Then every checkpoint is loaded by an engine of every kind,
built with another seed, which continues to STEPS: its losses are recorded beside the run that never stopped, and
(control) once without its optimizer state, by a `cpu` engine. With --load-only (another DP size), every checkpoint
is loaded by a ZeRO-2 engine without offload and by a ZeRO-3 engine with the optimizer on NVMe instead.
"""

import argparse
import json
import os
import sys

import bitsandbytes as bnb
import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.utils import safe_get_full_fp32_param

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)
import deepspeed_bnb  # noqa: E402,F401
from deepspeed_bnb.utils.teardown import finish  # noqa: E402

HIDDEN, CLASSES, GLOBAL_BATCH = 1024, 8, 8  # the batch splits into 2 ranks or 1
STEPS, SAVE_AT = 6, 3
AIO = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True, "thread_count": 1}
KINDS = ("cpu", "param_nvme", "opt_nvme", "both_nvme")
LOADERS_ELSEWHERE = ("stage2", "opt_nvme")  # --load-only: ZeRO-2 without offload, ZeRO-3 with the optimizer on NVMe


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.GELU(), torch.nn.Linear(HIDDEN, CLASSES))


def swap_root(out: str, kind: str, seed: int) -> str:
    return os.path.join(out, "swap", f"{kind}_seed{seed}")


MASTER = "fp32"  # zero_optimization.bnb_master_weights of every engine (--master-weights)


def config(kind: str, swap: str) -> dict:
    common = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // dist.get_world_size(),
              "gradient_accumulation_steps": 1, "bf16": {"enabled": True}, "steps_per_print": 10**9}
    if kind == "stage2":  # the loader at another DP size: no offload, another stage
        return {**common, "zero_optimization": {"stage": 2}}
    # sub-groups of one large weight each (its 2-rank partition), and one of the small rest, which stays in memory
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False,
            "bnb_master_weights": MASTER,
            "sub_group_size": HIDDEN * HIDDEN // 2,
            "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    if kind == "param_nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 6,
                                 "buffer_size": HIDDEN * HIDDEN, "max_in_cpu": 0}
    if kind in ("opt_nvme", "both_nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 4}
    if kind == "both_nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "buffer_count": 6,
                                 "buffer_size": HIDDEN * HIDDEN, "max_in_cpu": 0}
    return {**common, "zero_optimization": zero, "zero_force_ds_cpu_optimizer": False, "aio": AIO}


def build(kind: str, out: str, seed: int = 0):
    model = make_model(seed)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(kind, swap_root(out, kind, seed)))
    return engine


def batch(step: int, world: int, rank: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, HIDDEN, generator=g)
    y = torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g)
    per_rank = GLOBAL_BATCH // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine].to(torch.bfloat16), y[mine]


def train(engine, steps, world, rank):
    mine = []
    for step in steps:
        x, y = batch(step, world, rank)
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        mine.append(loss.item())
    summed = torch.tensor(mine, dtype=torch.float64)  # the global mean loss per step, in one collective
    dist.all_reduce(summed)
    return (summed / world).tolist()


def released(engine):
    """With the optimizer on NVMe: (swapped sub-groups, whether each one's fp32 partition and bnb state are out of
    memory); None otherwise."""
    opt = engine.optimizer
    if getattr(opt, "bnb_swapper", None) is None:
        return None
    on_nvme = [i for i in range(len(opt.fp16_groups)) if opt._bnb_on_nvme(i)]
    out = all(opt.fp32_partitioned_groups_flat[i].numel() == 0
              and all(t.numel() == 0 for t in opt._bnb_swapped_state(i).values()) for i in on_nvme)
    return [len(on_nvme), len(opt.fp16_groups), out]


def error_terms_in_use(engine) -> bool:
    """Whether some error term of compensated master weights is nonzero on this rank (each sub-group brought into
    memory to look; False for other master weights)."""
    opt = engine.optimizer
    found = False
    for i, error in enumerate(opt.bnb_master_errors):
        if error is not None:
            with opt._bnb_state_resident(i, read_only=True):
                found = found or bool((opt.bnb_master_errors[i] != 0).any())
    return found


def weights(engine) -> dict:
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def swap_files(out: str, kind: str, seed: int) -> int:
    """Swap files this rank holds under the kind's NVMe folder (0 when it has none)."""
    found = 0
    for folder, _, files in os.walk(swap_root(out, kind, seed)):
        found += sum(1 for name in files if name.endswith(".swp") and f"rank{dist.get_rank()}" in folder)
    return found


def everywhere(value: int) -> list:
    gathered = [None] * dist.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def outcome(call) -> str:
    try:
        call()
    except Exception as exc:  # the outcome is the result: the test reads it
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def build_at(kind: str, nvme_path: str, seed: int = 0):
    model = make_model(seed)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3, min_8bit_size=4096)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config(kind, nvme_path))[0]


def wipe_and_fill(folder: str) -> None:
    """Remove the optimizer's swap files under `folder` (fp32 partitions and bnb state, as a clean-up of the disk
    would), then write zeros into it until its file system is full: the next swap-out must create its files anew on a
    full disk (a rewrite of a file in place needs no new space)."""
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".swp") and "gradient" not in name and "params" not in root:
                os.remove(os.path.join(root, name))
    chunk = b"\0" * (1 << 20)
    with open(os.path.join(folder, "filler"), "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass


def faults(out: str, small_mount: str, world: int, rank: int) -> dict:
    """`unwritable`: nvme_path below a regular file; `full_disk`: the optimizer on NVMe on a small file system whose
    swap files are removed and which is filled up after SAVE_AT steps (and a checkpoint saved elsewhere), then one more
    step (its reads find the files gone, its writes a full disk) and a save; `resumed`: that
    checkpoint loaded by a `cpu` engine, continued to STEPS, beside a `cpu` run that never stopped."""
    results = {}
    blocker = os.path.join(out, "a_file")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    dist.barrier()
    results["unwritable"] = everywhere(outcome(lambda: build_at("opt_nvme", os.path.join(blocker, "nvme"))))
    engine = build_at("opt_nvme", small_mount)
    train(engine, range(SAVE_AT), world, rank)
    ckpt = os.path.join(out, "ckpt_fault")
    engine.save_checkpoint(ckpt, tag="good")
    if rank == 0:
        wipe_and_fill(small_mount)
    dist.barrier()
    results["full_disk"] = everywhere(outcome(lambda: train(engine, range(SAVE_AT, SAVE_AT + 1), world, rank)))
    results["save_after"] = everywhere(outcome(lambda: engine.save_checkpoint(ckpt, tag="after")))
    results["tags"] = sorted(os.listdir(ckpt))
    del engine
    reference = build("cpu", out)
    results["reference"] = train(reference, range(STEPS), world, rank)[SAVE_AT:]
    resumed = build("cpu", out, seed=1)
    resumed.load_checkpoint(ckpt, tag="good")
    results["resumed"] = train(resumed, range(SAVE_AT, STEPS), world, rank)
    return results


def main():
    global MASTER  # read by config() in every engine this process builds
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--load-only", action="store_true", help="load the saved checkpoints into ZeRO-2 engines")
    parser.add_argument("--faults", default=None, help="run the fault cases, the full disk on this (small) mount")
    parser.add_argument("--master-weights", default=MASTER, help="zero_optimization.bnb_master_weights of every engine")
    args = parser.parse_args()
    MASTER = args.master_weights
    # DeepSpeed before 0.19.8 (seen on 0.16.4, 0.18.4, 0.19.2) finds libaio missing once a torch JIT extension (the
    # fused kernel of the first engine here) is loaded: its has_function swallows the error. Loaded first, the op is
    # cached for every later engine (one engine per process, as a user runs, is not affected)
    from deepspeed.ops.op_builder import AsyncIOBuilder
    AsyncIOBuilder().load(verbose=False)
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.faults:
        results = faults(args.out, args.faults, world, rank)
        if rank == 0:
            with open(os.path.join(args.out, "nvme_faults.json"), "w") as f:
                json.dump(results, f, indent=1)
        return
    kinds = args.kinds.split(",")
    if args.load_only:
        loads = {}
        for saved in kinds:
            for loader in LOADERS_ELSEWHERE:
                engine = build(loader, args.out, seed=1)
                engine.load_checkpoint(os.path.join(args.out, "ckpt", saved), tag="s")
                loads[f"{saved}->{loader}"] = train(engine, range(SAVE_AT, STEPS), world, rank)
                del engine
        if rank == 0:
            with open(os.path.join(args.out, f"nvme_loads_world{world}.json"), "w") as f:
                json.dump(loads, f, indent=1)
        return
    results, finals = {"runs": {}, "loads": {}, "state_dropped": {}}, {}
    for kind in kinds:
        engine = build(kind, args.out)
        losses = train(engine, range(SAVE_AT), world, rank)
        engine.save_checkpoint(os.path.join(args.out, "ckpt", kind), tag="s")
        losses += train(engine, range(SAVE_AT, STEPS), world, rank)
        finals[kind] = weights(engine)
        reference = finals[kinds[0]]
        same = all(torch.equal(finals[kind][n], reference[n]) for n in reference)
        results["runs"][kind] = {"losses": losses, "weights_equal_first": same,
                                 "swap_files": everywhere(swap_files(args.out, kind, 0)),
                                 "released": everywhere(released(engine)),
                                 "error_terms_in_use": everywhere(error_terms_in_use(engine))}
        del engine
    for saved in kinds:
        for loader in kinds:
            engine = build(loader, args.out, seed=1)
            engine.load_checkpoint(os.path.join(args.out, "ckpt", saved), tag="s")
            losses = train(engine, range(SAVE_AT, STEPS), world, rank)
            final = weights(engine)
            results["loads"][f"{saved}->{loader}"] = {
                "losses": losses, "weights_equal": all(torch.equal(final[n], finals[saved][n]) for n in final)}
            del engine
        # the control's loader offloads to the CPU: DeepSpeed's load without optimizer state copies the 16-bit
        # partitions into the fp32 ones, and with parameters on NVMe it has none in memory (AttributeError on
        # 'NoneType', stock DeepSpeed alike)
        engine = build("cpu", args.out, seed=1)
        engine.load_checkpoint(os.path.join(args.out, "ckpt", saved), tag="s", load_optimizer_states=False)
        results["state_dropped"][saved] = train(engine, range(SAVE_AT, STEPS), world, rank)
        del engine
    if rank == 0:
        with open(os.path.join(args.out, "nvme_results.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
    finish()
