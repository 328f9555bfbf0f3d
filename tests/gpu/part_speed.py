"""GPU proof, part f: speed and memory, side by side in one process (measurements, not claims: no bar on a time).

A bf16 GPT (examples/gpt.py) of about 125M and 1B parameters trains under ZeRO-2 on the one device with each of:
bnb AdamW8bit through deepspeed_bnb with bnb's own update, with the fused kernel, and with bf16 and compensated bf16+8
master weights (bnb's own update; compensated also the fused kernel), torch AdamW(fused=True), DeepSpeed
FusedAdam (fp32 master weights and moments), and DeepSpeed's own bf16 master weights + bf16 optimizer states (its
FusedAdam). Per configuration: the median whole training step and `engine.step()` alone, peak
torch.cuda.max_memory_allocated, and the bytes of master weights and optimizer state per parameter. Then one optimizer
step over a flat 256M-element partition (benchmarks/bench_cuda_step.py's implementations) gives the fused kernel's
achieved bandwidth (16 bytes moved per element, 28 for fp32 AdamW) as a share of a device-to-device copy measured in
the same process and of the device's nominal bandwidth. On the CPU rehearsal the models and partitions are stand-ins
of a few hundred thousand elements (the numbers mean nothing there; the code path is the one the GPU runs).
"""

import gc
import os
import statistics
import time
import traceback

import proof_common as common

# device -> label -> GPTConfig arguments (vocab 256: bytes; the parameters are in the blocks)
MODELS = {"cuda": {"125M": dict(context=512, width=768, depth=18, heads=12),
                   "1B": dict(context=512, width=2048, depth=20, heads=16)},
          "cpu": {"stand-in 0.1M": dict(context=64, width=64, depth=2, heads=4),
                  "stand-in 0.4M": dict(context=64, width=128, depth=2, heads=4)}}
MICRO_BATCH = {"cuda": 8, "cpu": 2}
WARMUP = {"cuda": 2, "cpu": 1}
TIMED = {"cuda": 8, "cpu": 3}
KERNEL_ELEMENTS = {"cuda": 256 << 20, "cpu": 1 << 20}
KERNEL_ROUNDS = {"cuda": 20, "cpu": 3}
LR = 3e-4
# nominal memory bandwidth by device name (bytes/s): the vendors' data sheets
NOMINAL = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.04e12))


def configurations():
    """label -> (client optimizer maker, zero_optimization extras, bf16 section)."""
    import bitsandbytes as bnb
    import torch
    from deepspeed.ops.adam import FusedAdam
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before FusedAdam's JIT build (the proof prebuilds it the same way)
        os.environ["TORCH_CUDA_ARCH_LIST"] = common.deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    bf16 = {"enabled": True}
    ds_bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    return {
        "bnb AdamW8bit, bnb's update": (lambda g: bnb.optim.AdamW8bit(g, lr=LR), {"bnb_fused_kernel": False}, bf16),
        "bnb AdamW8bit, fused kernel": (lambda g: bnb.optim.AdamW8bit(g, lr=LR), {"bnb_fused_kernel": True}, bf16),
        "bnb AdamW8bit, bf16 master weights": (lambda g: bnb.optim.AdamW8bit(g, lr=LR),
                                               {"bnb_master_weights": "bf16"}, bf16),
        "bnb AdamW8bit, compensated bf16+8 master weights": (lambda g: bnb.optim.AdamW8bit(g, lr=LR),
                                                             {"bnb_master_weights": "bf16+8"}, bf16),
        "bnb AdamW8bit, compensated bf16+8, fused kernel": (lambda g: bnb.optim.AdamW8bit(g, lr=LR),
                                                            {"bnb_master_weights": "bf16+8", "bnb_fused_kernel": True},
                                                            bf16),
        "torch AdamW(fused=True)": (lambda g: torch.optim.AdamW(g, lr=LR, fused=True), {}, bf16),
        "DeepSpeed FusedAdam": (lambda g: FusedAdam(g, lr=LR, adam_w_mode=True), {}, bf16),
        "DeepSpeed bf16 master + bf16 states": (lambda g: FusedAdam(g, lr=LR, adam_w_mode=True), {}, ds_bf16),
    }


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def measure(label, maker, zero_extra, bf16, model_args, device):
    """Train one configuration; its row (median step and engine.step() in ms, peak GiB, bytes per parameter)."""
    import deepspeed
    import torch

    from gpt import GPT, GPTConfig, decay_groups
    from tensor_census import census
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated() if device == "cuda" else 0
    cfg = GPTConfig(**model_args)
    torch.manual_seed(0)  # the same initial model for every configuration
    with torch.device(device):
        model = GPT(cfg)
    params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH[device], "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": bf16, "zero_optimization": {"stage": 2, **zero_extra},
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine = deepspeed.initialize(model=model, optimizer=maker(decay_groups(model, 0.01)), config=config)[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (MICRO_BATCH[device], cfg.context), generator=g).to(device)
    targets = tokens.roll(-1, dims=1)
    steps, optimizer_steps, losses = [], [], []
    for i in range(WARMUP[device] + TIMED[device]):
        sync(device)
        t0 = time.perf_counter()
        loss = engine(tokens, targets)
        engine.backward(loss)
        sync(device)
        t1 = time.perf_counter()
        engine.step()
        sync(device)
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= WARMUP[device]:
            steps.append(t2 - t0)
            optimizer_steps.append(t2 - t1)
    held = census(engine)  # bytes per role, every storage counted once (benchmarks/tensor_census.py)
    master, state = held["master"], held["state"]
    summary = engine.optimizer.bnb_update_summary() if hasattr(engine.optimizer, "bnb_update_summary") else \
        type(engine.optimizer.optimizer).__name__
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    row = {"config": label, "update": summary, "params": params, "step_ms": 1e3 * statistics.median(steps),
           "optimizer_step_ms": 1e3 * statistics.median(optimizer_steps),
           "peak_gib": None if peak is None else peak / 2 ** 30,
           "peak_above_start_gib": None if peak is None else (peak - start_bytes) / 2 ** 30,
           "master_bytes_per_param": master / params, "state_bytes_per_param": state / params,
           "first_loss": losses[0], "last_loss": losses[-1]}
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    gc.collect()
    return row


def timed(run, device: str) -> float:
    """Seconds of one call of `run` (CUDA events on a GPU: the work is asynchronous)."""
    if device == "cuda":
        from bench_cuda_step import event_time
        return event_time(run)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def kernel_bandwidth(args, result):
    """One optimizer step over a flat partition: achieved bandwidth as a share of a copy and of the data sheet."""
    import bitsandbytes as bnb
    import torch

    import bench_optimizer_step as cpu_bench
    device, n = args.device, KERNEL_ELEMENTS[args.device]
    makers = {
        "deepspeed_bnb fused AdamW (8-bit)": (lambda: cpu_bench.fused("adam", n, True, device), 16),
        "bitsandbytes AdamW8bit": (lambda: cpu_bench.torch_optimizer(n, lambda p: bnb.optim.AdamW8bit(
            p, lr=cpu_bench.LR, betas=cpu_bench.BETAS, eps=cpu_bench.EPS, weight_decay=cpu_bench.WD,
            min_8bit_size=0), device), 16),
        "torch AdamW fused (fp32)": (lambda: cpu_bench.torch_optimizer(n, lambda p: torch.optim.AdamW(
            p, lr=cpu_bench.LR, betas=cpu_bench.BETAS, eps=cpu_bench.EPS, weight_decay=cpu_bench.WD, fused=True),
            device), 28),
    }
    src = torch.empty(n * 4, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    runs = {name: (make(), moved) for name, (make, moved) in makers.items()}
    for run, _ in runs.values():
        run()  # warm-up: state allocation, first-use check
    copy_times, times = [], {name: [] for name in runs}
    for _ in range(KERNEL_ROUNDS[device]):
        copy_times.append(timed(lambda: dst.copy_(src), device))
        for name, (run, _) in runs.items():
            times[name].append(timed(run, device))
    copy_rate = 2 * src.numel() / statistics.median(copy_times)  # bytes read + written per second
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    nominal = next((rate for key, rate in NOMINAL if key in name), None)
    rows = []
    for label, (_, moved) in runs.items():
        rate = n / statistics.median(times[label])
        achieved = rate * moved
        rows.append([label, f"{rate / 1e6:,.0f}", moved, f"{achieved / 1e9:,.0f}", f"{achieved / copy_rate:.0%}",
                     f"{achieved / nominal:.0%}" if nominal else "-"])
    result.table(f"f: one optimizer step over {n / 2 ** 20:.0f}M elements on {name} (median of "
                 f"{KERNEL_ROUNDS[device]} interleaved rounds); copy {copy_rate / 1e9:,.0f} GB/s read + written"
                 + (f", data sheet {nominal / 1e9:,.0f} GB/s" if nominal else ""),
                 ["implementation", "M elements/s", "bytes moved / element", "GB/s", "of copy", "of data sheet"],
                 rows)
    result.check("f: the optimizer-step bandwidth was measured for every implementation", len(rows) == len(makers),
                 f"{len(rows)} of {len(makers)}", "all")


def body(args, result):
    import torch
    common.one_rank(args.device)
    import deepspeed_bnb  # noqa: F401
    configs = configurations()
    for size, model_args in MODELS[args.device].items():
        rows = []
        for label, (maker, zero_extra, bf16) in configs.items():
            try:
                rows.append(measure(label, maker, zero_extra, bf16, model_args, args.device))
            except Exception as exc:  # one configuration failing must not hide the others
                traceback.print_exc()  # into proof.log
                rows.append({"config": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if args.device == "cuda":
                torch.cuda.empty_cache()
        failed = [r["config"] + ": " + r["error"] for r in rows if "error" in r]
        unfinished = [r["config"] for r in rows if "error" not in r and not (r["last_loss"] == r["last_loss"])]
        result.check(f"f: {size}: every configuration trained (finite loss)", not failed and not unfinished,
                     "; ".join(failed + unfinished) or f"{len(rows)} configurations", "all ran, finite losses")
        result.table(f"f: {size} GPT ({rows[0].get('params', 0) / 1e6:,.1f}M parameters), bf16, ZeRO-2, micro batch "
                     f"{MICRO_BATCH[args.device]} x {model_args['context']} tokens, median of {TIMED[args.device]} "
                     f"steps after {WARMUP[args.device]}",
                     ["configuration", "update", "step ms", "engine.step() ms", "peak GiB", "peak above start GiB",
                      "master B/param", "state B/param", "master + state B/param", "loss first -> last"],
                     [[r["config"], "-", "error", "-", "-", "-", "-", "-", "-", r["error"]] if "error" in r else
                      [r["config"], r["update"], f"{r['step_ms']:.1f}", f"{r['optimizer_step_ms']:.1f}",
                       "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
                       "-" if r["peak_above_start_gib"] is None else f"{r['peak_above_start_gib']:.2f}",
                       f"{r['master_bytes_per_param']:.2f}", f"{r['state_bytes_per_param']:.2f}",
                       f"{r['master_bytes_per_param'] + r['state_bytes_per_param']:.2f}",
                       f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}"] for r in rows])
    kernel_bandwidth(args, result)


if __name__ == "__main__":
    common.run_part("f", "speed and memory", body)
