"""Optimizer-step throughput on a CUDA GPU: deepspeed_bnb's fused 8-bit CUDA kernels against torch's fused fp32
AdamW and, where bitsandbytes is installed, its own CUDA 8-bit optimizers; with each one's share of the GPU's
measured copy bandwidth.

One optimizer step over a flat fp32 parameter (16M-256M elements by default, sizes that fill the chip), timed with
CUDA events (the device's time: event_time) as the median of repeated rounds after a warm-up, each round stepping every
implementation once in turn.
The step is memory-bound, so the table also gives the bytes each implementation must move per element at the least
(every input read once, every output written once: 8-bit AdamW 16 B, 8-bit Lion and SGD-momentum 14 B, fp32 AdamW
28 B) over its time, against a device-to-device copy measured in the same run (bytes read plus written).

    python benchmarks/bench_cuda_step.py                    # where deepspeed and bitsandbytes are installed
    python tests/support/cuda_kernel_run.py --bench                 # a GPU machine: CUDA tests, then this table
"""

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_optimizer_step as cpu_bench  # noqa: E402  (the same states and hyper-parameters as the CPU table)

bnb = cpu_bench.bnb

# implementation -> maker of one step on the GPU (bytes moved per element: cpu_bench.least_bytes)
IMPLEMENTATIONS = {
    "deepspeed_bnb CUDA kernel AdamW (8-bit)": lambda n: cpu_bench.fused("adam", n, True, "cuda"),
    # the ZeRO step's two ways to the model's bf16 weights (runtime/zero/lp_copy.py): the kernel writes them
    # (DEEPSPEED_BNB_KERNEL_LP_COPY=gpu), or torch converts the updated fp32 weights after it (DeepSpeed's copy)
    "deepspeed_bnb CUDA kernel AdamW (8-bit), writing the model's bf16 copy":
        lambda n: cpu_bench.fused("adam", n, True, "cuda", model_copy=True),
    "deepspeed_bnb CUDA kernel AdamW (8-bit), then torch's bf16 copy":
        lambda n: cpu_bench.then_bf16_copy(cpu_bench.fused("adam", n, True, "cuda"), n),
    "torch AdamW fused (fp32)": lambda n: cpu_bench.torch_optimizer(n, lambda p: torch.optim.AdamW(
        p, lr=cpu_bench.LR, betas=cpu_bench.BETAS, eps=cpu_bench.EPS, weight_decay=cpu_bench.WD, fused=True), "cuda"),
    "bitsandbytes CUDA AdamW8bit": lambda n: cpu_bench.torch_optimizer(n, lambda p: bnb.optim.AdamW8bit(
        p, lr=cpu_bench.LR, betas=cpu_bench.BETAS, eps=cpu_bench.EPS, weight_decay=cpu_bench.WD, min_8bit_size=0),
        "cuda"),
    "deepspeed_bnb CUDA kernel Lion (8-bit)": lambda n: cpu_bench.fused("lion", n, True, "cuda"),
    "bitsandbytes CUDA Lion8bit": lambda n: cpu_bench.torch_optimizer(n, lambda p: bnb.optim.Lion8bit(
        p, lr=cpu_bench.LION_LR, betas=cpu_bench.LION_BETAS, weight_decay=cpu_bench.WD, min_8bit_size=0), "cuda"),
    "deepspeed_bnb CUDA kernel SGD-momentum (8-bit)": lambda n: cpu_bench.fused("momentum", n, True, "cuda"),
    "bitsandbytes CUDA SGD8bit": lambda n: cpu_bench.torch_optimizer(n, lambda p: bnb.optim.SGD8bit(
        p, lr=cpu_bench.SGD_LR, momentum=cpu_bench.SGD_MOMENTUM, weight_decay=cpu_bench.WD, min_8bit_size=0), "cuda"),
}
SAME_RULE = {"Lion": "bitsandbytes CUDA Lion8bit", "SGD-momentum": "bitsandbytes CUDA SGD8bit"}


# GPU clock cycles of the sleep queued ahead of a timed call: about 2.5 ms at 2 GHz, longer than any call's host work
LEAD_CYCLES = 5_000_000


def event_time(run, lead: bool = True) -> float:
    """Seconds of the device work of one call of `run`, by CUDA events. `lead`: a sleep kernel is queued first, so the
    device is still busy while the host runs `run` (Python, hyper rows, launches) and reaches the start event only
    then: the time is the device's, as in training, where the host queues ahead of the device (`run` must not wait
    for the device). Without it (lead False, as the GPU runs of 2026-11-29 and before timed) the time holds the host's
    work too: on the H200 part f's AdamW step (a blocking hyper-row copy, Python) read 1.92 ms where part k's, the same
    kernel called more directly, read 1.80."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if lead:
        torch.cuda._sleep(LEAD_CYCLES)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bandwidth(n_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written (the memory ceiling)."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n_bytes / statistics.median(event_time(lambda: dst.copy_(src)) for _ in range(repeats)) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[16, 64, 256], help="millions of elements (2^20)")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (median reported)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_step.py: no CUDA device here (torch.cuda.is_available() is False)")
    if not cpu_bench.loader.load():
        sys.exit("bench_cuda_step.py: the fused kernels could not be built here (see the warning above)")
    ceiling = copy_bandwidth()
    print(f"torch {torch.__version__}, bitsandbytes {getattr(bnb, '__version__', '?')}, "
          f"{torch.cuda.get_device_name()}; device-to-device copy {ceiling:,.0f} GB/s (read + written)\n")
    print("| elements | implementation | M elements/s | GB/s (least bytes) | of copy bandwidth | vs torch fused fp32 "
          "AdamW | vs bnb CUDA 8-bit, same rule |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        n = int(size * (1 << 20))
        runs, times = {}, {}
        for name, make in IMPLEMENTATIONS.items():
            try:
                runs[name] = make(n)
                runs[name]()  # warm-up: state allocation, JIT, caches
                torch.cuda.synchronize()
                times[name] = []
            except Exception as exc:  # bnb missing or unable to run here: report, keep going
                print(f"| {size:g}M | {name} | unavailable: {type(exc).__name__}: {str(exc)[:80]} | | | | |")
                runs.pop(name, None)
        for _ in range(args.repeats):
            for name, run in runs.items():
                times[name].append(event_time(run))
        rates = {name: n / statistics.median(t) / 1e6 for name, t in times.items()}
        torch_rate = rates.get("torch AdamW fused (fp32)")
        for name, rate in rates.items():
            rule = next((bnb_name for key, bnb_name in SAME_RULE.items() if key in name or bnb_name == name),
                        "bitsandbytes CUDA AdamW8bit")
            gbs = rate * 1e6 * cpu_bench.least_bytes(name) / 1e9
            vs_torch = f"{rate / torch_rate:.2f}x" if torch_rate else "-"
            vs_bnb = f"{rate / rates[rule]:.2f}x" if rule in rates else "-"
            print(f"| {size:g}M | {name} | {rate:,.0f} | {gbs:,.0f} | {gbs / ceiling:.0%} | {vs_torch} | {vs_bnb} |",
                  flush=True)
        del runs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
