"""GPU proof, part s: where `engine.step()` spends its time, taken apart and profiled, for the fused kernel and torch.

Part f times `engine.step()` whole: at 1B (ZeRO-2, bf16, one H200) the fused 8-bit step took 65.7 ms against torch's
fused AdamW's 58.3, while either optimizer alone moves its bytes in about 10 ms, so most of the step is DeepSpeed's own
work around the optimizer, shared by every configuration. This part says which work, for the configurations of part f
that decide the ratio (the fused kernel, bnb's own update, torch's fused AdamW), at the 1B GPT (part s3: ZeRO-3's
step; part so: ZeRO-2 with the optimizer offloaded to the CPU, the fused C++ kernel beside DeepSpeedCPUAdam and
torch's CPU AdamW):
- the parts of `engine.step()` (benchmarks/step_breakdown.py's wrapping of DeepSpeed's methods: the inf/NaN check, the
  gradient norm, the flatten, the unscale/clip, the optimizer, the parameters' re-pointing, the all-gather), each
  begun and ended with a device synchronize so that it holds the device work it queued; what is left of the step is
  DeepSpeed's code between them (the gradient partition's conversion to fp32 among it);
- one step under torch.profiler: the wall time, the device's busy time (the union of its kernels and copies) and so
  how long the device waited for the host, kernels launched, the host's synchronizing CUDA calls, the kernels and
  host operations that took longest;
- deepspeed_bnb's inf/NaN check before the step (runtime/utils.py: one fp64 norm per gradient piece, batched) against
  DeepSpeed's per-piece one on this device, at the largest finite values and with inf and NaN;
- DeepSpeed's gradient norm (each piece converted to fp64, then its norm) against the same norms computed without the
  fp64 copy (`torch.linalg.vector_norm(g, dtype=torch.float64)` per piece, and `torch._foreach_norm`): equal bits or
  not, and the time of each, on this step's gradients. A faster norm may only replace DeepSpeed's where its bits are
  the same (the clip factor, and so every update, depends on them).
On the CPU rehearsal the model is a stand-in and there is no device timeline (the host's operations are shown).
"""

import gc
import statistics
import time
import traceback

import proof_common as common
from part_speed import (BNB_UPDATE, FUSED, MICRO_BATCH, MODELS, OFFLOAD_LABELS, TORCH_FUSED, build, configurations,
                        sync)

LABELS = (FUSED, BNB_UPDATE, TORCH_FUSED)
SIZE = "1B"
WARMUP = {"cuda": 2, "cpu": 1}
TIMED = {"cuda": 5, "cpu": 2}
TOP = 6  # kernels and host operations listed per configuration
# the CUDA runtime and driver calls that make the host wait for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def train_step(engine, tokens, targets, device: str) -> None:
    """Forward and backward, the device idle afterwards (what engine.step() then queues is its own)."""
    engine.backward(engine(tokens, targets))
    sync(device)


def instrument(timer, stage: int) -> tuple:
    """Wrap the methods behind the parts of the stage's `step()` (each class's own where deepspeed_bnb's overrides
    one); returns the parts' labels."""
    import step_breakdown
    if stage != 3:
        step_breakdown.instrument(timer, step_breakdown.TOP_LEVEL)
        return step_breakdown.TOP_LEVEL
    step_breakdown.instrument_stage3(timer, nested=())
    return step_breakdown.STAGE3_TOP_LEVEL


def breakdown(engine, tokens, targets, device: str, timer, labels: tuple) -> dict:
    """label -> median seconds per step of each part, engine.step() and what the parts leave ("other")."""
    times = {}
    for _ in range(TIMED[device]):
        train_step(engine, tokens, targets, device)
        timer.reset()
        started = time.perf_counter()
        engine.step()
        sync(device)
        total = time.perf_counter() - started
        parts = timer.reset()
        times.setdefault("engine.step()", []).append(total)
        times.setdefault("other", []).append(total - sum(parts.values()))
        for label in labels:
            times.setdefault(label, []).append(parts.get(label, 0.0))
    return {label: statistics.median(values) for label, values in times.items()}


def merged_length(intervals) -> float:
    """Total length of the union of (start, end) intervals."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total


def short(name: str) -> str:
    """A kernel's name without its template arguments and return type, at most 70 characters."""
    name = name.split("<")[0].split("(")[0]
    return (name[5:] if name.startswith("void ") else name)[:70]


def profiled(engine, tokens, targets, device: str) -> dict:
    """One engine.step() under torch.profiler: wall, device busy, launches, syncs, top kernels and host ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    train_step(engine, tokens, targets, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        engine.step()
        sync(device)
        wall = time.perf_counter() - started
    events = prof.events()
    on_device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    kernels = {}
    for e in on_device:
        count, spent = kernels.get(short(e.name), (0, 0.0))
        kernels[short(e.name)] = (count + 1, spent + e.time_range.elapsed_us())
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.key.startswith("aten::")]
    calls = {e.key: e.count for e in prof.key_averages()}
    return {"wall": wall,
            "busy": merged_length((e.time_range.start, e.time_range.end) for e in on_device) * 1e-6 if on_device
            else None,
            "launches": sum(calls.get(name, 0) for name in LAUNCH_CALLS),
            "syncs": sum(calls.get(name, 0) for name in SYNC_CALLS),
            "kernels": sorted(kernels.items(), key=lambda item: -item[1][1])[:TOP],
            "host": [(e.key, e.count, e.self_cpu_time_total) for e in
                     sorted(host, key=lambda e: -e.self_cpu_time_total)[:TOP]]}


NORM_WAYS = ("DeepSpeed: vector_norm(g.to(float64)) per piece", "vector_norm(g, dtype=float64) per piece",
             "torch._foreach_norm(grads, 2, dtype=float64)")


def norms_by(way: str, grads: list) -> list:
    """The 2-norm of each gradient piece in fp64, computed one of NORM_WAYS (the first is get_grad_norm_direct's)."""
    import torch
    if way == NORM_WAYS[0]:
        return [torch.linalg.vector_norm(g.data.to(torch.float64), ord=2.0) for g in grads]
    if way == NORM_WAYS[1]:
        return [torch.linalg.vector_norm(g.data, ord=2.0, dtype=torch.float64) for g in grads]
    return list(torch._foreach_norm([g.data for g in grads], 2.0, dtype=torch.float64))


def norm_alternatives(engine, tokens, targets, device: str) -> list:
    """DeepSpeed's per-piece gradient norm against two ways without the fp64 copy, on one step's gradients (each
    param group's, as DeepSpeed's step hands them to get_grad_norm_direct): [(way, pieces, same bits as DeepSpeed's
    for every piece and every group's sum of squares, median seconds per step)]."""
    import torch
    optimizer = engine.optimizer
    real = optimizer.get_grad_norm_direct
    found = {way: {"same": True, "seconds": [0.0] * TIMED[device], "pieces": 0} for way in NORM_WAYS}

    def comparing(gradients, params, norm_type=2):
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        reference = None
        for way in NORM_WAYS:
            for i in range(TIMED[device]):
                sync(device)
                started = time.perf_counter()
                norms = norms_by(way, grads)
                sync(device)
                found[way]["seconds"][i] += time.perf_counter() - started
            squares = torch.stack(norms).pow(2.0).sum() if norms else None
            if reference is None:
                reference = (norms, squares)
            found[way]["pieces"] += len(grads)
            found[way]["same"] &= len(norms) == len(reference[0]) and all(
                torch.equal(a, b) for a, b in zip(norms, reference[0])) and (
                squares is None or torch.equal(squares, reference[1]))
        return real(gradients, params, norm_type)
    optimizer.get_grad_norm_direct = comparing
    try:
        train_step(engine, tokens, targets, device)
        engine.step()
    finally:
        del optimizer.get_grad_norm_direct  # the class's own again
    return [(way, f["pieces"], f["same"], statistics.median(f["seconds"])) for way, f in found.items()]


def overflow_check_agrees(device: str, result) -> None:
    """deepspeed_bnb's batched inf/NaN check (its fp64 norms) against DeepSpeed's per-piece one, on this device: the
    largest finite values of each dtype (2^20 of them: fp32 squares would overflow), +-inf and NaN."""
    import torch

    from deepspeed_bnb.runtime.utils import any_inf_or_nan
    from support.overflow_oracle import deepspeeds_answer
    wrong, cases = [], 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        largest = torch.finfo(dtype).max
        for bad in (None, float("inf"), float("-inf"), float("nan")):
            pieces = [torch.full((1 << 20,), largest, dtype=dtype, device=device),
                      torch.randn(4099, device=device).to(dtype), torch.zeros(0, dtype=dtype, device=device)]
            if bad is not None:
                pieces[1][1234] = bad
            theirs = deepspeeds_answer([pieces])
            mine = bool(any_inf_or_nan(pieces, device))
            cases += 1
            if mine != theirs or theirs != (bad is not None):
                wrong.append(f"{dtype} {bad}: ours {mine}, DeepSpeed's {theirs}")
    result.check("s: the batched inf/NaN check answers as DeepSpeed's on this device (fp32, bf16, fp16: the largest "
                 "finite values, +-inf, NaN)", not wrong, "; ".join(wrong) or f"{cases} cases agree", "all agree")


def body(args, result):
    common.one_rank(args.device)
    import deepspeed_bnb  # noqa: F401
    import step_breakdown
    device, stage, offload = args.device, args.stage, args.offload
    part = part_name(stage, offload)
    timer = step_breakdown.Timer(sync=lambda: sync(device))
    labels = instrument(timer, stage)
    if stage != 3 and not offload:  # ZeRO-3 checks its flat gradient buffers itself; offload checks in backward
        overflow_check_agrees(device, result)
    configs, model_args = configurations(2, offload), MODELS[device][SIZE]
    parts, profiles, norms, failed, params = {}, {}, {}, {}, 0
    taken_apart = OFFLOAD_LABELS if offload else LABELS  # part f3's offload rows, or part f's deciding ones
    for label in taken_apart:
        engine = None
        try:
            engine, _, tokens, targets, params = build(configs[label], stage, offload, model_args, device)
            for _ in range(WARMUP[device]):
                train_step(engine, tokens, targets, device)
                engine.step()
            timer.reset()
            parts[label] = breakdown(engine, tokens, targets, device, timer, labels)
            profiles[label] = profiled(engine, tokens, targets, device)
            if stage != 3 and not offload:  # ZeRO-3 norms flat partitions; offload its pieces in backward
                norms[label] = norm_alternatives(engine, tokens, targets, device)
        except Exception as exc:  # one configuration failing must not hide the others
            traceback.print_exc()
            failed[label] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:  # the next configuration's memory is its own
            if engine is not None:
                engine.destroy()
            del engine
        gc.collect()
        if device == "cuda":
            import torch
            torch.cuda.empty_cache()
    named = SIZE if device == "cuda" else f"stand-in for the {SIZE}"
    where = (f"ZeRO-{stage}{', optimizer offloaded to the CPU' if offload else ''}, bf16, {named} GPT "
             f"({params / 1e6:,.1f}M parameters), micro batch {MICRO_BATCH[device]}")
    result.check(f"{part}: every configuration was taken apart and profiled",
                 not failed and len(parts) == len(taken_apart),
                 "; ".join(f"{k}: {v}" for k, v in failed.items()) or f"{len(parts)} configurations", "all")
    columns = ("engine.step()", *labels, "other")
    result.table(f"{part}: engine.step() taken apart, {where}: ms per step, median of {TIMED[device]} steps, each part "
                 f"between device synchronizations" + (" (other: DeepSpeed's conversion of the updated fp32 partition "
                                                      "into its bf16 buffer on the host, which the fused kernel's row "
                                                      "writes in the kernel instead, and the buffer's copy to the "
                                                      "device)" if offload else ""), ["configuration", *columns],
                 [[label, *(f"{row[c] * 1e3:.2f}" for c in columns)] for label, row in parts.items()])
    over = {label: row for label, row in parts.items() if row["other"] < -0.05 * row["engine.step()"]}
    result.check(f"{part}: the parts add up to no more than the step (none counted twice)", not over,
                 "; ".join(f"{k}: other {v['other'] * 1e3:.2f} ms" for k, v in over.items()) or "yes", "yes")
    rows = []
    for label, p in profiles.items():
        busy = "-" if p["busy"] is None else f"{p['busy'] * 1e3:.2f} ({p['busy'] / p['wall']:.0%})"
        rows.append([label, f"{p['wall'] * 1e3:.2f}", busy, p["launches"], p["syncs"]])
    result.table(f"{part}: one engine.step() under torch.profiler, {where} (the profiler's own overhead included)",
                 ["configuration", "wall ms", "device busy ms (of wall)", "kernel launches",
                  "synchronizing CUDA calls"], rows)
    result.table(f"{part}: the longest kernels of that step (device time)",
                 ["configuration", "kernel", "launches", "ms"],
                 [[label, name, count, f"{spent / 1e3:.2f}"] for label, p in profiles.items()
                  for name, (count, spent) in p["kernels"]])
    result.table(f"{part}: the host operations of that step with the most time of their own (host time)",
                 ["configuration", "operation", "calls", "ms"],
                 [[label, name, count, f"{spent / 1e3:.2f}"] for label, p in profiles.items()
                  for name, count, spent in p["host"]])
    if device == "cuda":
        result.check(f"{part}: the profiler saw the device's work", all(p["busy"] for p in profiles.values()),
                     ", ".join(f"{p['busy']}" for p in profiles.values()), "device time in every profile")
    if norms:
        result.table(f"{part}: DeepSpeed's gradient norm against the same norms without its fp64 copy (this step's "
                     "gradients)", ["configuration", "computed as", "pieces", "same bits as DeepSpeed's", "ms"],
                     [[label, way, pieces, "yes" if same else "no", f"{spent * 1e3:.2f}"]
                      for label, rows in norms.items() for way, pieces, same, spent in rows])


def part_name(stage: int, offload: bool) -> str:
    return "so" if offload else "s" if stage == 2 else "s3"


def extra(parser):
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2, help="the ZeRO stage taken apart")
    parser.add_argument("--offload", action="store_true", help="ZeRO-2 with the optimizer offloaded to the CPU: "
                        "the fused C++ kernel, DeepSpeedCPUAdam and torch's CPU AdamW (part f's offload rows)")


if __name__ == "__main__":
    import sys
    stage = int(sys.argv[sys.argv.index("--stage") + 1]) if "--stage" in sys.argv else 2
    offload = "--offload" in sys.argv
    common.run_part(part_name(stage, offload), "where engine.step() spends its time"
                    + (", optimizer offloaded to the CPU" if offload else "" if stage == 2 else ", ZeRO-3"),
                    body, extra)
