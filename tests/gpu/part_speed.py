"""GPU proof, parts f and f3: speed inside the engine, side by side in one process, and the kernels' bandwidth.

A bf16 GPT (deepspeed_bnb/demo/gpt.py) trains on the one device with each configuration of a suite:
  f   ZeRO-2 at about 125M and 1B parameters: bnb AdamW8bit through deepspeed_bnb with bnb's own update and with the
      fused kernel (fp32, bf16 and compensated bf16+8 master weights; and with fp32 ones the kernel also writing the
      model's bf16 copy, DEEPSPEED_BNB_KERNEL_LP_COPY=gpu), stock DeepSpeed stepping a bnb AdamW8bit client
      (what users run today), torch AdamW(fused=True), DeepSpeed FusedAdam, DeepSpeed's bf16 master weights + bf16
      states, and torchao's AdamW8bit where it is installed and runs as a DeepSpeed client;
  f3  at about 1B parameters: ZeRO-3 (the fused kernel with fp32 master weights, without and with its model copy, and
      with bf16 and compensated bf16+8 ones, torch's fused AdamW) and ZeRO-2 with the optimizer offloaded to the CPU
      (the fused C++ kernel with fp32, bf16 and compensated bf16+8 master weights, DeepSpeedCPUAdam, torch's fused CPU
      AdamW). bnb's own update, slower than the kernel everywhere part f has timed both, gives ZeRO-3's time to the
      master-weight rows, whose bar (1.1x the fp32-master step) holds at every stage.
Interleaved: every round builds each configuration's engine in turn, warms it up and times its steps (the whole
training step, and engine.step() alone), then frees it; ROUNDS rounds, so each configuration's timed steps come from
separate rounds and a drift of the machine shows as spread, not as a ranking. Reported: the median and the range of
each, the host synchronizations one engine.step() and one backward make (torch.cuda.set_sync_debug_mode counts
them; stock DeepSpeed with torch's fused AdamW is the reference count), and the ratios the project aims at (fused 8-bit
engine.step() at most 0.8x torch's fused AdamW, the whole step at most 1.02x, bf16 and bf16+8 master weights at most
1.1x the fp32-master 8-bit step) as checks on a GPU. Peak memory comes from fresh processes (part m), since engines
built one after another in one process leave memory behind.
f also times one optimizer step over a flat 256M-element partition (benchmarks/bench_optimizer_step.py's fused kernel,
also writing the model's bf16 copy and followed by torch's copy, and torch optimizers): the achieved bandwidth (16 bytes
moved per element for 8-bit AdamW, 28 for fp32 AdamW) as a share of a device-to-device copy measured in the same rounds
and of the data sheet, timed as the device's work (bench_cuda_step.event_time: the host's Python and launches hidden
behind a queued sleep) and, in a column of its own, with the host's work included as earlier runs timed it; part p
profiles it.
On the CPU rehearsal the models and partitions are stand-ins (the numbers mean nothing there; the code path is the
one the GPU runs; the ratio checks become notes).
"""

import contextlib
import gc
import os
import statistics
import time
import traceback
import warnings

import proof_common as common

# device -> label -> GPTConfig arguments (vocab 256: bytes; the parameters are in the blocks)
MODELS = {"cuda": {"125M": dict(context=512, width=768, depth=18, heads=12),
                   "1B": dict(context=512, width=2048, depth=20, heads=16)},
          "cpu": {"125M": dict(context=64, width=64, depth=2, heads=4),
                  "1B": dict(context=64, width=128, depth=2, heads=4)}}
MICRO_BATCH = {"cuda": 8, "cpu": 2}
# part f: three rounds on a GPU, so that one round's engine (each round builds its own) cannot hold half of the steps:
# at 125M on the H200 of 2026-11-29, 2 x 10 steps gave bf16 master weights 19.9 ms (18.8-32.3) against the fp32
# master's 14.6 (12.2-21.2), ranges that overlap. Part f3: two rounds of 10, since there building each 1B engine takes
# longer than its steps (2026-11-29: 145 s for 6 configurations in two rounds) and it times 10 configurations
ROUNDS = {"f": {"cuda": 3, "cpu": 2}, "f3": {"cuda": 2, "cpu": 2}}
WARMUP = {"cuda": 2, "cpu": 1}
TIMED = {"f": {"cuda": 7, "cpu": 2}, "f3": {"cuda": 10, "cpu": 2}}  # per round: 21 and 20 timed steps on a GPU
KERNEL_ELEMENTS = {"cuda": 256 << 20, "cpu": 1 << 20}
KERNEL_ROUNDS = {"cuda": 20, "cpu": 3}
LR = 3e-4
# nominal memory bandwidth by device name (bytes/s): the vendors' data sheets
NOMINAL = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.04e12))
FUSED, BNB_UPDATE, TORCH_FUSED = "bnb AdamW8bit, fused kernel", "bnb AdamW8bit, bnb's update", "torch AdamW(fused=True)"
# the fused kernel also writing the model's bf16 copy of the updated weights (DEEPSPEED_BNB_KERNEL_LP_COPY=gpu), where
# DeepSpeed's step otherwise converts each partition after it (runtime/zero/lp_copy.py): an opt-in until this row shows
# it at least as fast as FUSED
FUSED_COPY = "bnb AdamW8bit, fused kernel writing the model's copy"
BF16_MASTER, COMPENSATED = "bnb AdamW8bit, bf16 master weights, fused", "bnb AdamW8bit, bf16+8 master weights, fused"
COPY_IN_KERNEL = "deepspeed_bnb fused AdamW (8-bit), writing the model's bf16 copy"
COPY_AFTER = "deepspeed_bnb fused AdamW (8-bit), then torch's bf16 copy"
LP_COPY_ENV = "DEEPSPEED_BNB_KERNEL_LP_COPY"  # runtime/zero/lp_copy.py: ENV
# the optimizer offloaded to the CPU: the fused C++ kernel and torch's fused AdamW on the host
OFFLOAD_FUSED, OFFLOAD_TORCH = "bnb AdamW8bit, fused C++ kernel", "torch AdamW(fused=True), CPU"
# and the kernel with bf16 and compensated master weights on the host (the bars: 1.1x the fp32-master step)
OFFLOAD_LABELS = (OFFLOAD_FUSED, "DeepSpeedCPUAdam", OFFLOAD_TORCH, BF16_MASTER, COMPENSATED)
# the suites of each part: (stage, offload, model sizes, configurations)
SUITES = {"f": [(2, False, ("125M", "1B"), None)],
          "f3": [(3, False, ("1B",), (FUSED, FUSED_COPY, BF16_MASTER, COMPENSATED, TORCH_FUSED)),
                 (2, True, ("1B",), OFFLOAD_LABELS)]}


class Config:
    """One configuration: its optimizer maker, zero_optimization extras, bf16 section, whether stock DeepSpeed
    (deepspeed_bnb's integration taken back) builds it, and environment settings while it runs."""

    def __init__(self, maker, zero=None, bf16=None, stock=False, top=None, env=None):
        self.maker, self.zero, self.stock = maker, zero or {}, stock
        self.bf16 = bf16 or {"enabled": True}
        self.top = top or {}  # top-level config keys
        self.env = env or {}  # environment variables set from its build to its last step


def configurations(stage: int, offload: bool) -> dict:
    """label -> Config for a suite."""
    import bitsandbytes as bnb
    import torch
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before FusedAdam's JIT build (the proof prebuilds it the same way)
        os.environ["TORCH_CUDA_ARCH_LIST"] = common.deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])

    def bnb8(g):
        return bnb.optim.AdamW8bit(g, lr=LR)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        client = {"zero_force_ds_cpu_optimizer": False}
        return {OFFLOAD_FUSED: Config(bnb8, {"bnb_fused_kernel": "auto"}, top=client),
                "DeepSpeedCPUAdam": Config(lambda g: DeepSpeedCPUAdam(g, lr=LR, adamw_mode=True)),
                OFFLOAD_TORCH: Config(lambda g: torch.optim.AdamW(g, lr=LR, fused=True), top=client),
                BF16_MASTER: Config(bnb8, {"bnb_master_weights": "bf16", "bnb_fused_kernel": "auto"}, top=client),
                COMPENSATED: Config(bnb8, {"bnb_master_weights": "bf16+8", "bnb_fused_kernel": "auto"}, top=client)}
    from deepspeed.ops.adam import FusedAdam
    ds_bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    untested = {"zero_allow_untested_optimizer": True}
    configs = {
        BNB_UPDATE: Config(bnb8, {"bnb_fused_kernel": False}),
        FUSED: Config(bnb8, {"bnb_fused_kernel": True}),
        FUSED_COPY: Config(bnb8, {"bnb_fused_kernel": True}, env={LP_COPY_ENV: "gpu"}),
        BF16_MASTER: Config(bnb8, {"bnb_master_weights": "bf16", "bnb_fused_kernel": True}),
        COMPENSATED: Config(bnb8, {"bnb_master_weights": "bf16+8", "bnb_fused_kernel": True}),
        "stock DeepSpeed, bnb AdamW8bit client": Config(bnb8, stock=True, top=untested),
        TORCH_FUSED: Config(lambda g: torch.optim.AdamW(g, lr=LR, fused=True)),
        "DeepSpeed FusedAdam": Config(lambda g: FusedAdam(g, lr=LR, adam_w_mode=True)),
        "DeepSpeed bf16 master + bf16 states": Config(lambda g: FusedAdam(g, lr=LR, adam_w_mode=True), bf16=ds_bf16),
    }
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit
        configs["torchao AdamW8bit"] = Config(lambda g: TorchaoAdamW8bit(g, lr=LR), top=untested)
    except ModuleNotFoundError:  # not installed: no row
        pass
    except Exception:  # a torchao this torch cannot import: no row, and why in proof.log
        traceback.print_exc()
    return configs


def sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def counting_syncs(device: str, counts: list):
    """Appends the host synchronizations made inside (torch's sync debug mode warns once per synchronizing call)."""
    if device != "cuda":
        yield
        return
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts.append(sum("synchroniz" in str(w.message) for w in caught))


def build(config: Config, stage: int, offload: bool, model_args: dict, device: str):
    """(engine, model, tokens, targets, parameters) of one configuration."""
    import deepspeed
    import torch

    from deepspeed_bnb.demo.gpt import GPT, GPTConfig, decay_groups
    from deepspeed_bnb.runtime.engine import stock_deepspeed
    cfg = GPTConfig(**model_args)
    torch.manual_seed(0)  # the same initial model for every configuration
    with torch.device(device):
        model = GPT(cfg)
    zero = {"stage": stage, **config.zero}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH[device], "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "bf16": config.bf16, "zero_optimization": zero,
                 "steps_per_print": 10 ** 9, "wall_clock_breakdown": False, **config.top}
    if stage == 3:
        zero.setdefault("memory_efficient_linear", False)
    with stock_deepspeed() if config.stock else contextlib.nullcontext():
        engine = deepspeed.initialize(model=model, optimizer=config.maker(decay_groups(model, 0.01)),
                                      config=ds_config)[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (MICRO_BATCH[device], cfg.context), generator=g).to(device)
    # ZeRO-3 has partitioned the parameters by now: their full sizes are ds_numel
    return engine, model, tokens, tokens.roll(-1, dims=1), sum(getattr(p, "ds_numel", p.numel())
                                                               for p in model.parameters())


def timed_round(label: str, config: Config, stage: int, offload: bool, model_args: dict, device: str,
                into: dict, timed: int) -> None:
    """Build, warm up and time one configuration once (`timed` steps, under its environment settings); its times,
    losses and sync counts go into into[label]."""
    with common.environment(config.env):
        _timed_round(label, config, stage, offload, model_args, device, into, timed)


def _timed_round(label: str, config: Config, stage: int, offload: bool, model_args: dict, device: str,
                 into: dict, timed: int) -> None:
    import torch
    row = into.setdefault(label, {"steps": [], "optimizer_steps": [], "syncs": [], "backward_syncs": [], "losses": [],
                                  "params": None})
    engine, model, tokens, targets, row["params"] = build(config, stage, offload, model_args, device)
    row["update"] = engine.optimizer.bnb_update_summary() if hasattr(engine.optimizer, "bnb_update_summary") else \
        type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    for i in range(WARMUP[device] + timed):
        sync(device)
        t0 = time.perf_counter()
        counting = i == WARMUP[device] - 1 and not row["syncs"]  # once per configuration, untimed
        loss = engine(tokens, targets)
        # the backward's own host syncs too: under ZeRO-Offload DeepSpeed reads an inf/NaN check of every
        # parameter's gradient back to the host there
        with counting_syncs(device, row["backward_syncs"]) if counting else contextlib.nullcontext():
            engine.backward(loss)
        sync(device)
        t1 = time.perf_counter()
        if counting:
            with counting_syncs(device, row["syncs"]):
                engine.step()
        else:
            engine.step()
        sync(device)
        t2 = time.perf_counter()
        row["losses"].append(float(loss))
        if i >= WARMUP[device]:
            row["steps"].append(t2 - t0)
            row["optimizer_steps"].append(t2 - t1)
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def spread(values) -> str:
    return f"{1e3 * statistics.median(values):.1f} ({1e3 * min(values):.1f}-{1e3 * max(values):.1f})"


def suite(args, result, stage: int, offload: bool, sizes, labels) -> None:
    configs = configurations(stage, offload)
    if labels:
        configs = {label: configs[label] for label in labels}
    where = f"ZeRO-{stage}" + (", optimizer offloaded to the CPU" if offload else "")
    rounds, timed = ROUNDS[args.suite][args.device], TIMED[args.suite][args.device]
    for size in sizes if args.device == "cuda" else sizes[:1]:  # the rehearsal: one stand-in size (the same path)
        model_args = MODELS[args.device][size]
        rows, failed = {}, {}
        for _ in range(rounds):
            for label, config in configs.items():
                if label in failed:
                    continue
                try:
                    timed_round(label, config, stage, offload, model_args, args.device, rows, timed)
                except Exception as exc:  # one configuration failing must not hide the others
                    traceback.print_exc()  # into proof.log
                    failed[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    rows.pop(label, None)
                    gc.collect()
        ok = {label: r for label, r in rows.items() if r["steps"]}
        finite = all(r["losses"][-1] == r["losses"][-1] for r in ok.values())
        result.check(f"{where}, {size}: every configuration trained (finite loss)",
                     not failed and finite, "; ".join(f"{k}: {v}" for k, v in failed.items())
                     or f"{len(ok)} configurations", "all ran, finite losses",
                     note="torchao's AdamW8bit counts only where it is installed")
        reference = ok.get(TORCH_FUSED) or ok.get(OFFLOAD_TORCH)
        table = []
        for label, r in ok.items():
            ratio = "-" if reference is None else \
                f"{statistics.median(r['optimizer_steps']) / statistics.median(reference['optimizer_steps']):.2f}"
            table.append([label, r["update"], spread(r["steps"]), spread(r["optimizer_steps"]), ratio,
                          r["syncs"][0] if r["syncs"] else "-",
                          r["backward_syncs"][0] if r["backward_syncs"] else "-",
                          f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"])
        table += [[label, "-", "failed", "-", "-", "-", "-", why] for label, why in failed.items()]
        params = next(iter(ok.values()))["params"] if ok else 0
        named = size if args.device == "cuda" else f"stand-in for the {size}"
        result.table(f"{where}, {named} GPT ({params / 1e6:,.1f}M parameters), bf16, micro batch "
                     f"{MICRO_BATCH[args.device]} x {model_args['context']} tokens: ms, median (range) of "
                     f"{rounds} x {timed} steps, configurations interleaved",
                     ["configuration", "update", "step ms", "engine.step() ms", "engine.step() / torch fused",
                      "host syncs in engine.step()", "host syncs in backward", "loss first -> last"], table)
        ratios(args, result, where, size, ok)
        result.checkpoint()  # a deadline in the next size or suite costs that one, not this one's rows


def ratios(args, result, where: str, size: str, rows: dict) -> None:
    """The ratios the project aims at: checks on a GPU, notes on the rehearsal's stand-ins."""
    def median(label, key):
        return statistics.median(rows[label][key]) if label in rows and rows[label][key] else None

    claims = []
    # on the device, or (the optimizer offloaded) both on the host: the same bars
    fused, torch_fused, where_torch = ((OFFLOAD_FUSED, OFFLOAD_TORCH, " on the CPU") if OFFLOAD_FUSED in rows
                                       else (FUSED, TORCH_FUSED, ""))
    torch_step, fused_step = median(torch_fused, "optimizer_steps"), median(fused, "optimizer_steps")
    if torch_step and fused_step:
        claims.append((f"fused 8-bit engine.step() <= 0.8 x torch AdamW(fused=True)'s{where_torch}",
                       fused_step / torch_step, 0.8))
        claims.append((f"fused 8-bit training step <= 1.02 x torch AdamW(fused=True)'s{where_torch}",
                       median(fused, "steps") / median(torch_fused, "steps"), 1.02))
    for label in (BF16_MASTER, COMPENSATED):
        if fused_step and median(label, "optimizer_steps"):
            claims.append((f"{label.split(', ')[1]} engine.step() <= 1.1 x the fp32-master fused one",
                           median(label, "optimizer_steps") / fused_step, 1.1))
    if fused_step and median(FUSED_COPY, "optimizer_steps"):  # what would make the kernel's copy the GPU's default
        claims.append(("the fused kernel writing the model's copy: engine.step() <= 1.0 x DeepSpeed's copy after it",
                       median(FUSED_COPY, "optimizer_steps") / fused_step, 1.0))
    torch_syncs = rows.get(torch_fused, {}).get("syncs")
    fused_syncs = rows.get(fused, {}).get("syncs")
    for name, measured, bar in claims:
        if args.device == "cuda":
            result.check(f"{where}, {size}: {name}", measured <= bar, f"{measured:.2f}", f"<= {bar}")
        else:
            result.note(f"{where}, {size}: {name}: {measured:.2f} on the CPU stand-in (a GPU claim)")
    if args.device == "cuda" and torch_syncs and fused_syncs:
        result.check(f"{where}, {size}: the fused engine.step() synchronizes the host no more than stock DeepSpeed "
                     f"with torch's fused AdamW{where_torch}", fused_syncs[0] <= torch_syncs[0],
                     f"{fused_syncs[0]} vs {torch_syncs[0]}", "<= torch's")


def timed(run, device: str, lead: bool = True) -> float:
    """Seconds of one call of `run` (CUDA events on a GPU: the work is asynchronous; `lead`: the device's time alone,
    bench_cuda_step.event_time)."""
    if device == "cuda":
        from bench_cuda_step import event_time
        return event_time(run, lead)
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def kernel_runs(device: str, n: int) -> dict:
    """name -> (one optimizer step over n elements, bytes it must move per element)."""
    import bitsandbytes as bnb
    import torch

    import bench_optimizer_step as bench

    def bnb_adamw(p):
        return bnb.optim.AdamW8bit(p, lr=bench.LR, betas=bench.BETAS, eps=bench.EPS, weight_decay=bench.WD,
                                   min_8bit_size=0)

    def torch_adamw(p):
        return torch.optim.AdamW(p, lr=bench.LR, betas=bench.BETAS, eps=bench.EPS, weight_decay=bench.WD, fused=True)
    return {"deepspeed_bnb fused AdamW (8-bit)": (bench.fused("adam", n, True, device), 16),
            # the ZeRO step's two ways to the model's bf16 weights: the kernel writes them (2 bytes more), or torch
            # converts the updated fp32 weights after it (DeepSpeed's copy: 6 bytes more)
            COPY_IN_KERNEL: (bench.fused("adam", n, True, device, model_copy=True), 18),
            COPY_AFTER: (bench.then_bf16_copy(bench.fused("adam", n, True, device), n), 22),
            "deepspeed_bnb fused Lion (8-bit)": (bench.fused("lion", n, True, device), 14),
            "deepspeed_bnb fused SGD-momentum (8-bit)": (bench.fused("momentum", n, True, device), 14),
            "bitsandbytes AdamW8bit": (bench.torch_optimizer(n, bnb_adamw, device), 16),
            "torch AdamW fused (fp32)": (bench.torch_optimizer(n, torch_adamw, device), 28)}


def kernel_bandwidth(args, result):
    """One optimizer step over a flat partition: achieved bandwidth as a share of a copy and of the data sheet."""
    import torch
    device, n = args.device, KERNEL_ELEMENTS[args.device]
    runs = kernel_runs(device, n)
    src = torch.empty(n * 4, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for run, _ in runs.values():
        run()  # warm-up: state allocation, first-use check
    copy_times, times, hosted = [], {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(KERNEL_ROUNDS[device]):
        copy_times.append(timed(lambda: dst.copy_(src), device))
        for name, (run, _) in runs.items():
            times[name].append(timed(run, device))
            hosted[name].append(timed(run, device, lead=False))  # as the runs before 2026-11-30 timed it
    copy_rate = 2 * src.numel() / statistics.median(copy_times)  # bytes read + written per second
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    nominal = next((rate for key, rate in NOMINAL if key in name), None)
    rows, shares = [], {}
    for label, (_, moved) in runs.items():
        rate = n / statistics.median(times[label])
        shares[label] = rate * moved / copy_rate
        with_host = n * moved / statistics.median(hosted[label]) / copy_rate
        rows.append([label, f"{rate / 1e6:,.0f}", moved, f"{rate * moved / 1e9:,.0f}", f"{shares[label]:.0%}",
                     f"{with_host:.0%}", f"{rate * moved / nominal:.0%}" if nominal else "-"])
    result.table(f"f: one optimizer step over {n / 2 ** 20:.0f}M elements on {name} (median of "
                 f"{KERNEL_ROUNDS[device]} interleaved rounds); copy {copy_rate / 1e9:,.0f} GB/s read + written"
                 + (f", data sheet {nominal / 1e9:,.0f} GB/s" if nominal else ""),
                 ["implementation", "M elements/s", "bytes moved / element", "GB/s", "of copy",
                  "of copy, the host's work included", "of data sheet"],
                 rows)
    result.check("f: the optimizer-step bandwidth was measured for every implementation", len(rows) == len(runs),
                 f"{len(rows)} of {len(runs)}", "all")
    ours, theirs = shares["deepspeed_bnb fused AdamW (8-bit)"], shares["bitsandbytes AdamW8bit"]
    claims = [("fused 8-bit AdamW moves >= 70% of the copy bandwidth", ours, ">= 0.70", ours >= 0.70),
              ("fused 8-bit AdamW >= 3x bitsandbytes' AdamW8bit", ours / theirs, ">= 3", ours >= 3 * theirs)]
    for rule in ("Lion", "SGD-momentum"):
        share = shares[f"deepspeed_bnb fused {rule} (8-bit)"]
        claims.append((f"fused 8-bit {rule} moves >= 70% of the copy bandwidth", share, ">= 0.70", share >= 0.70))
    in_kernel, after = (statistics.median(times[label]) for label in (COPY_IN_KERNEL, COPY_AFTER))
    claims.append(("the AdamW kernel writing the model's bf16 copy takes less time than the kernel then torch's copy",
                   in_kernel / after, "< 1", in_kernel < after))
    for name, measured, bar, holds in claims:
        if device == "cuda":
            result.check(f"f: {name}", holds, f"{measured:.2f}", bar)
        else:
            result.note(f"f: {name}: {measured:.2f} on the CPU stand-in (a GPU claim)")


def body(args, result):
    common.one_rank(args.device)
    import deepspeed_bnb  # noqa: F401
    for stage, offload, sizes, labels in SUITES[args.suite]:
        suite(args, result, stage, offload, sizes, labels)
    if args.suite == "f":
        kernel_bandwidth(args, result)


def extra(parser):
    parser.add_argument("--suite", choices=sorted(SUITES), default="f", help="which suites: f (ZeRO-2, two sizes, "
                        "and the kernels' bandwidth) or f3 (ZeRO-3 and CPU offload at 1B)")


if __name__ == "__main__":
    import sys
    suite_name = sys.argv[sys.argv.index("--suite") + 1] if "--suite" in sys.argv else "f"
    common.run_part(suite_name, "speed inside the engine" + (", ZeRO-3 and offload" if suite_name == "f3" else ""),
                    body, extra)
