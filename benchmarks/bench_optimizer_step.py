"""Optimizer-step throughput on CPU: deepspeed_bnb's fused 8-bit kernels against the alternatives.

For each size and thread count, one optimizer step over a flat fp32 parameter of that many elements, timed as the
median of repeated rounds after a warm-up (each round steps every implementation once, in turn), for:
deepspeed_bnb's C++ kernels (8-bit state), bitsandbytes' own CPU 8-bit path (AdamW8bit, Lion8bit, SGD8bit),
torch.optim.AdamW(fused=True) (fp32 state), DeepSpeedCPUAdam (fp32 state) and deepspeed_bnb's pure-torch reference
(the fallback; small sizes only). Prints a markdown table of M elements/s and the ratio to torch's fused AdamW and
to bnb's CPU path of the same update rule (AdamW8bit, Lion8bit or SGD8bit), measured in the same run; and the bytes
each implementation must move per element at the least (8-bit AdamW 16 B, 8-bit Lion and SGD-momentum 14 B, fp32
AdamW 28 B) over its time, against an in-place pass over memory (x = -x) timed in the same rounds: how close each
step is to the memory ceiling, the bound a many-core host's optimizer step hits first.

    python benchmarks/bench_optimizer_step.py              # 1M..64M elements, 1 and 2 threads (a few minutes)
    python benchmarks/bench_optimizer_step.py --quick      # 1M elements, 1 thread: a smoke test
    python benchmarks/bench_optimizer_step.py --cold --sizes 0.42 --threads 1   # from memory, as inside training
    python benchmarks/bench_optimizer_step.py --march x86-64-v3 --sizes 0.42 --threads 1   # the AVX2 path, here
    python benchmarks/bench_optimizer_step.py --sizes 0.42 --threads 1 --rows "deepspeed_bnb C++ kernel (8-bit)" \
        "torch AdamW fused (fp32)" "DeepSpeedCPUAdam (fp32)"   # some rows: fewer share the rounds, more stays cached
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bitsandbytes as bnb  # noqa: E402

from deepspeed_bnb.ops import cpu_features, loader, rules  # noqa: E402
from deepspeed_bnb.state_layout import GroupLayout  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LION_LR, LION_BETAS = 1e-4, (0.9, 0.99)
SGD_LR, SGD_MOMENTUM = 1e-2, 0.9
# each rule's settings as bnb's get_config gives them (SGD's betas: momentum, dampening), as the fused rows see them
CONFIGS = {"adam": {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD},
           "lion": {"lr": LION_LR, "betas": LION_BETAS, "eps": EPS, "weight_decay": WD},
           "momentum": {"lr": SGD_LR, "betas": (SGD_MOMENTUM, 0.0), "eps": EPS, "weight_decay": WD}}


def fused(rule, n, use_kernel, device="cpu", arithmetic=None, eight_bit=True, model_copy=False, master="fp32"):
    """One step of deepspeed_bnb's fused `rule` over a flat partition of n elements with 8-bit state (eight_bit
    False: fp32 state, the kernel's path without (de)quantization), its hyper row rebuilt every step as the ZeRO
    optimizer does (the step counter starts at 1: the warm-up round), in the arithmetic the ZeRO step computes on
    `device` (a GPU: bnb's own; use_kernel False: its oracle) unless `arithmetic` says. model_copy: the kernel also
    writes the model's bf16 copy of the updated weights (lp_params), as the ZeRO steps have it do. master: the master
    weights, "fp32", "bf16" or "bf16+8" (bf16 with int8 error terms: bnb_master_weights' modes)."""
    update = rules.get(rule)
    signed = rules.SIGNED_MAPS[:update.moments]  # one map per moment
    params, grads = torch.randn(n, device=device), torch.randn(n, device=device) * 1e-3
    error = torch.zeros(n, dtype=torch.int8, device=device) if master == "bf16+8" else None
    params = params if master == "fp32" else params.bfloat16()
    codes = [torch.full((n,), 127 if s else 0, dtype=torch.uint8, device=device) for s in signed]  # code of 0.0
    absmax = [torch.zeros(-(-n // 256), device=device) for _ in signed]
    qmaps = [bnb.functional.create_dynamic_map(s).to(device) for s in signed]
    empty = [torch.zeros(0 if eight_bit else n, device=device) for _ in signed]  # the fp32 state of 32-bit segments
    table = rules.segment_table(GroupLayout((n,), 1).segments(0, [eight_bit]), [0]).to(device)
    step = [0]
    arithmetic = arithmetic or rules.arithmetic_for(device)
    copy = torch.zeros(n, dtype=torch.bfloat16, device=device) if model_copy else None

    def run():
        step[0] += 1
        hyper = update.rows([CONFIGS[rule]], step[0], arithmetic)
        # as the ZeRO step sends it (optim/fused/partition.py): from pinned memory, without waiting for the device
        hyper = hyper.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" \
            else hyper.to(device)
        rules.step_(update, params, grads, codes, absmax, empty, qmaps, table, hyper, None, error, arithmetic, copy,
                    use_kernel=use_kernel)
    run.params = params  # the master weights it updates (then_bf16_copy)
    return run


def then_bf16_copy(run, n):
    """`run`, then the model's bf16 copy of the updated fp32 weights by torch, as DeepSpeed's ZeRO-1/2 step converts
    each partition after the optimizer (`bit16_partition_buffer.copy_(fp32_partition)`)."""
    params = getattr(run, "params", None)
    if params is None:  # a torch optimizer: its one parameter
        params = run.__self__.param_groups[0]["params"][0].detach()
    copy = torch.zeros(n, dtype=torch.bfloat16, device=params.device)

    def wrapped():
        run()
        copy.copy_(params)
    return wrapped


KEY_LOOKUP_ENV = "DEEPSPEED_BNB_CPU_KEY_LOOKUP"  # csrc/cpu/quantize_keys.h: KeyLookup


def with_key_lookup(run, lookup: str):
    """`run` with the CPU kernels' quantizer set to `lookup` ("runs", the default, "gather" or "scalar") for each of
    its calls: the kernels read the setting at every call, so rows with any of them interleave in one process."""
    def wrapped():
        before = os.environ.get(KEY_LOOKUP_ENV)
        os.environ[KEY_LOOKUP_ENV] = lookup
        try:
            run()
        finally:
            if before is None:
                del os.environ[KEY_LOOKUP_ENV]
            else:
                os.environ[KEY_LOOKUP_ENV] = before
    return wrapped


def torch_optimizer(n, factory, device="cpu"):
    param = torch.nn.Parameter(torch.randn(n, device=device))
    param.grad = torch.randn(n, device=device) * 1e-3
    optimizer = factory([param])
    return optimizer.step


def memory_pass(n):
    """x = -x over an fp32 array in place: each byte read once and written once, as an optimizer step updates its
    parameters and states; the memory ceiling of a step that only streams its bytes. (A copy into a second array is
    no yardstick on CPUs: its stores first read the destination lines in (write allocate): ~60% of this.)"""
    x = torch.randn(n)
    return x.neg_


def deepspeed_cpu_adam(n):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    return torch_optimizer(n, lambda p: DeepSpeedCPUAdam(p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                         adamw_mode=True))


YARDSTICK = "memory: in-place pass x = -x (the ceiling; fastest round)"
COPY_FUSED = "deepspeed_bnb C++ kernel (8-bit), writing the model's bf16 copy"
COPY_AFTER = "deepspeed_bnb C++ kernel (8-bit), then torch's bf16 copy"
GATHER_KEYS = "deepspeed_bnb C++ kernel (8-bit), key table gathered"
SCALAR_KEYS = "deepspeed_bnb C++ kernel (8-bit), key entries by scalar loads"
BF16_MASTER = "deepspeed_bnb C++ kernel (8-bit), bf16 master weights"
COMPENSATED_MASTER = "deepspeed_bnb C++ kernel (8-bit), bf16+8 master weights"
IMPLEMENTATIONS = {
    YARDSTICK: memory_pass,
    "deepspeed_bnb C++ kernel (8-bit)": lambda n: fused("adam", n, True),
    # the same kernel with the quantizer's codes from the key table instead of the map's runs (AVX-512 path; the same
    # codes), its entries gathered, or loaded one by one (faster than the gather where gathers are slow)
    GATHER_KEYS: lambda n: with_key_lookup(fused("adam", n, True), "gather"),
    SCALAR_KEYS: lambda n: with_key_lookup(fused("adam", n, True), "scalar"),
    # the step and the model's bf16 copy of the weights, as inside a ZeRO-1/2 step: written by the kernel, or converted
    # by torch after it (DeepSpeed's pass, which the CPU step without the kernel's copy makes)
    COPY_FUSED: lambda n: fused("adam", n, True, model_copy=True),
    COPY_AFTER: lambda n: then_bf16_copy(fused("adam", n, True), n),
    "DeepSpeedCPUAdam (fp32), then torch's bf16 copy": lambda n: then_bf16_copy(deepspeed_cpu_adam(n), n),
    # the same kernel with bf16 and compensated (bf16 + int8 error) master weights: bnb_master_weights' modes
    BF16_MASTER: lambda n: fused("adam", n, True, master="bf16"),
    COMPENSATED_MASTER: lambda n: fused("adam", n, True, master="bf16+8"),
    # the same kernel and update without the 8-bit round trip: what requantizing costs, by difference
    "deepspeed_bnb C++ kernel, fp32 state (no quantization)": lambda n: fused("adam", n, True, eight_bit=False),
    "bitsandbytes CPU AdamW8bit": lambda n: torch_optimizer(n, lambda p: bnb.optim.AdamW8bit(
        p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, min_8bit_size=0)),
    "torch AdamW fused (fp32)": lambda n: torch_optimizer(n, lambda p: torch.optim.AdamW(
        p, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)),
    "DeepSpeedCPUAdam (fp32)": deepspeed_cpu_adam,
    "deepspeed_bnb reference (pure torch)": lambda n: fused("adam", n, False),
    "deepspeed_bnb C++ kernel Lion (8-bit)": lambda n: fused("lion", n, True),
    "bitsandbytes CPU Lion8bit": lambda n: torch_optimizer(n, lambda p: bnb.optim.Lion8bit(
        p, lr=LION_LR, betas=LION_BETAS, weight_decay=WD, min_8bit_size=0)),
    "deepspeed_bnb C++ kernel SGD-momentum (8-bit)": lambda n: fused("momentum", n, True),
    "bitsandbytes CPU SGD8bit": lambda n: torch_optimizer(n, lambda p: bnb.optim.SGD8bit(
        p, lr=SGD_LR, momentum=SGD_MOMENTUM, weight_decay=WD, min_8bit_size=0)),
}


def least_bytes(name: str) -> int:
    """Bytes an implementation must move per element at the least (every input read once, every output written once):
    fp32 AdamW 28 (param, gradient, two fp32 moments), 8-bit AdamW 16 (param, gradient, two 1-byte codes; with bf16
    master weights 12, bf16+8 ones 14), 8-bit Lion and SGD-momentum 14 (one code); the per-block absmax adds 1/32 B per
    state, left out."""
    if name == YARDSTICK:
        return 8
    copy = 2 if "bf16 copy" in name else 0  # the model's copy written (its fp32 source need not be read again)
    if "fp32" in name:
        return 28 + copy
    if name in (BF16_MASTER, COMPENSATED_MASTER):  # the weights read and written as 2 (bf16) or 3 (+ error) bytes
        return 12 if name == BF16_MASTER else 14
    return (14 if ("Lion" in name or "SGD" in name) else 16) + copy


# the bnb row each fused row is compared with: same update rule
SAME_RULE = {"Lion": "bitsandbytes CPU Lion8bit", "SGD-momentum": "bitsandbytes CPU SGD8bit"}
REFERENCE_MAX = 4 << 20  # the pure-torch reference is slow: time it on small sizes only


EVICT_BYTES = 32 << 20  # --cold: the pass before each timed step, larger than this VM's last-level cache share


def measure_interleaved(makers, n, repeats, cold=False):
    """M elements/s per implementation: median over `repeats` rounds, each round timing one step of every
    implementation in turn, so that a slow spell of this shared machine hits all of them alike (the ratios are what
    the table is for). The yardstick (memory_pass) reports its fastest round instead: it stands for the ceiling, and on
    a shared machine its median reads below what torch's fused AdamW itself moves. `cold`: an untimed pass over
    EVICT_BYTES before each timed step, so that the step finds its data in memory, not the caches, as it does in
    training (the backward pass runs in between)."""
    evict = torch.zeros(EVICT_BYTES // 4) if cold else None
    runs, rates = {}, {}
    for name, make in makers.items():
        try:
            runs[name] = make(n)
            runs[name]()  # warm-up: state allocation, JIT, caches
        except Exception as exc:  # e.g. DeepSpeedCPUAdam needs its op built: report, keep going
            rates[name] = f"unavailable: {type(exc).__name__}: {str(exc)[:80]}"
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            if evict is not None:
                evict.add_(1.0)
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    for name in runs:
        rates[name] = n / (min(times[name]) if name == YARDSTICK else statistics.median(times[name])) / 1e6
    return {name: rates[name] for name in makers}


def cpu_description():
    """The CPU model and which full-block path the loaded build runs: the table's numbers depend on it far more than
    on the core count (csrc/cpu/adam8bit_avx512.h needs AVX-512 F, BW and DQ, quantize_keys.h AVX2)."""
    try:
        with open("/proc/cpuinfo") as info:
            text = info.read()
        model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                     "?")
    except OSError:
        model = "CPU unknown"
    needs = loader.compiled_for() if loader.load() else None
    return f"{model}, kernel: {cpu_features.kernel_path(needs) if needs is not None else 'not compiled'}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64], help="millions of elements (2^20)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch.set_num_threads values")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--quick", action="store_true", help="1M elements, 1 thread, 3 repeats")
    parser.add_argument("--cold", action="store_true", help="a 32 MB pass before each timed step (the data then comes "
                        "from memory, as in training; the default times steps on data the previous round left cached)")
    parser.add_argument("--march", help="build the C++ kernels for this gcc -march (x86-64-v3: the AVX2 path; "
                        "x86-64-v4: the AVX-512 path without VBMI) instead of this machine's CPU, so that one machine "
                        "compares the paths other hosts run")
    parser.add_argument("--rows", nargs="+", metavar="NAME",
                        help="only these rows, by their names in the table (the memory pass always runs); fewer rows "
                             "leave more of each one's data in the caches between its steps")
    args = parser.parse_args()
    unknown = sorted(set(args.rows or ()) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--rows: no row named {', '.join(map(repr, unknown))}; the rows: "
                     f"{', '.join(map(repr, IMPLEMENTATIONS))}")
    if args.march:
        from deepspeed_bnb.ops import build_flags
        # the loader compiles with this list (its JIT cache is named after the target, so each -march builds once)
        build_flags.CPU_FLAGS[build_flags.CPU_FLAGS.index("-march=native")] = f"-march={args.march}"
    if args.quick:
        args.sizes, args.threads, args.repeats = [1], [1], 3
    if not loader.load():
        print(f"note: the C++ kernels could not be built ({loader.error()}); their rows say unavailable")
    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__}, {os.cpu_count()} CPUs ({cpu_description()})\n")
    print("| elements | threads | implementation | M elements/s | GB/s (least bytes) | of streaming bandwidth "
          "| vs torch fused fp32 AdamW | vs bnb CPU 8-bit, same rule |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        n = int(size * (1 << 20))
        for threads in args.threads:
            torch.set_num_threads(threads)
            makers = {name: make for name, make in IMPLEMENTATIONS.items()
                      if not ("reference" in name and n > REFERENCE_MAX)
                      and (not args.rows or name == YARDSTICK or name in args.rows)}
            rates = measure_interleaved(makers, n, args.repeats, args.cold)
            for name, rate in list(rates.items()):
                if isinstance(rate, str):
                    print(f"| {size:g}M | {threads} | {name} | {rate} | | | | |")
                    del rates[name]
            torch_rate = rates.get("torch AdamW fused (fp32)")
            ceiling = rates[YARDSTICK] * 1e6 * least_bytes(YARDSTICK) / 1e9
            for name, rate in rates.items():
                rule = next((bnb_name for key, bnb_name in SAME_RULE.items() if key in name or bnb_name == name),
                            "bitsandbytes CPU AdamW8bit")
                bnb_rate = rates.get(rule)
                vs_torch = f"{rate / torch_rate:.2f}x" if torch_rate and name != YARDSTICK else "-"
                vs_bnb = f"{rate / bnb_rate:.1f}x" if bnb_rate and name != YARDSTICK else "-"
                gbs = rate * 1e6 * least_bytes(name) / 1e9
                print(f"| {size:g}M | {threads} | {name} | {rate:,.0f} | {gbs:.1f} | {gbs / ceiling:.0%} | "
                      f"{vs_torch} | {vs_bnb} |", flush=True)


if __name__ == "__main__":
    main()
