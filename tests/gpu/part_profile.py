"""GPU proof, part p: why each optimizer step runs at its speed: a profile of one step over a 256M-element partition.

Profiled, one step each after a warm-up: deepspeed_bnb's fused AdamW kernel in bnb's CUDA arithmetic (what the ZeRO
step runs on a GPU) and in the IEEE one, bitsandbytes' AdamW8bit (its blockwise kernel), torch's fused fp32 AdamW,
and a device-to-device copy (the bandwidth yardstick).
- With Nsight Compute (`ncu`, where it is installed and allowed to read the GPU's counters): per kernel, DRAM
  throughput as a share of peak, achieved occupancy, registers per thread, the occupancy limit (sections SpeedOfLight,
  Occupancy, LaunchStats, WarpStateStats, from `ncu --csv`); and, from a second run of the fused kernels alone, where
  their warps wait (the smsp__average_warps_issue_stalled_* metrics: cycles per issued instruction by reason).
- Otherwise torch.profiler: per kernel, its name, launches and device time, and the bandwidth that time implies for
  the bytes the step must move.
- Registers, shared memory and spills of the built kernels: `cuobjdump -res-usage` on the extension, where found.
On the CPU rehearsal: torch.profiler over the C++ kernel and torch's CPU AdamW (no device counters there).
"""

import csv
import glob
import io
import os
import shutil
import subprocess
import sys

import proof_common as common

ELEMENTS = {"cuda": 256 << 20, "cpu": 1 << 20}
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats")
# ncu metric names (lower case) shown per kernel, and their column titles
METRICS = (("dram throughput", "DRAM % of peak"), ("achieved occupancy", "achieved occupancy %"),
           ("registers per thread", "registers / thread"), ("block limit registers", "block limit (registers)"),
           ("duration", "duration"))
KERNELS = r"regex:fused_step_kernel|kOptimizerStatic8bit2StateBlockwise|multi_tensor|copy"
LAUNCHES = 64  # profiled launches: torch's fused AdamW takes one per chunk of the 256M elements, the others one each
# the warp stall breakdown (cycles per issued instruction, per reason), asked for by name pattern in a second ncu run
# of the fused kernels alone: a pattern this ncu does not know costs that table only
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


def steps(device: str, n: int) -> dict:
    """name -> one step (callable) of each profiled implementation, warmed up; and the bytes it moves per element."""
    import torch

    from deepspeed_bnb.ops import rules
    import bench_optimizer_step as bench
    from part_speed import kernel_runs
    every = kernel_runs(device, n)
    runs = {name: every[name] for name in ("deepspeed_bnb fused AdamW (8-bit)", "bitsandbytes AdamW8bit",
                                           "torch AdamW fused (fp32)")}
    if device == "cuda":  # the IEEE arithmetic on the same device: other rounding rules, the same kernel shape
        runs["deepspeed_bnb fused AdamW (8-bit), ieee arithmetic"] = (bench.fused("adam", n, True, device,
                                                                                  rules.IEEE), 16)
    src = torch.empty(n * 4, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    runs["copy (yardstick)"] = (lambda: dst.copy_(src), 8)
    for run, _ in runs.values():
        run()
    return runs


def child(args, result):
    """Run each step once (the profiled process under ncu, or under torch.profiler here)."""
    import torch
    runs = steps(args.device, ELEMENTS[args.device])
    if args.under_ncu:
        for run, _ in runs.values():
            run()
        torch.cuda.synchronize()
        result.check("p: the profiled steps ran", True, f"{len(runs)} implementations", "ran")
        return
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CUDA] if args.device == "cuda" else [ProfilerActivity.CPU]
    rows = []
    for name, (run, moved) in runs.items():
        with profile(activities=activities) as prof:
            run()
            if args.device == "cuda":
                torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if (e.device_time_total if args.device == "cuda"
                                                      else e.self_cpu_time_total) > 0]
        total = sum(e.device_time_total if args.device == "cuda" else e.self_cpu_time_total for e in events)
        top = sorted(events, key=lambda e: -(e.device_time_total if args.device == "cuda" else e.self_cpu_time_total))
        n = ELEMENTS[args.device]
        rows.append([name, "; ".join(f"{e.key[:60]} x{e.count}" for e in top[:3]), f"{total / 1e3:.2f}",
                     f"{n * moved / (total * 1e-6) / 1e9:,.0f}" if total else "-"])
    result.table(f"p: torch.profiler, one step over {ELEMENTS[args.device] / 2 ** 20:.0f}M elements "
                 f"({'device' if args.device == 'cuda' else 'CPU'} time)",
                 ["implementation", "top kernels (launches)", "ms", "GB/s implied"], rows)
    result.check("p: every implementation was profiled", len(rows) == len(runs), f"{len(rows)}", "all")


def ncu_binary():
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None) or \
        next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)


def ncu_profile(args, result) -> bool:
    """The kernels' counters from Nsight Compute; False where ncu is missing or may not read the counters."""
    ncu = ncu_binary()
    if ncu is None:
        result.note("p: Nsight Compute (ncu) is not installed here: torch.profiler instead")
        return False
    path = os.path.join(args.work, "profile_ncu.json")
    child = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--result", path, "--work", args.work,
             "--bundle", args.bundle, "--under-ncu"]
    cmd = [ncu, "--csv", "--page", "details", "--kernel-name", KERNELS, "--launch-skip", "0", "--launch-count",
           str(LAUNCHES), *[x for s in SECTIONS for x in ("--section", s)], *child]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    no_permission = "ERR_NVGPUCTRPERM" in done.stdout + done.stderr
    if no_permission or done.returncode != 0:
        why = "no permission to read the GPU counters" if no_permission else (done.stderr or done.stdout).strip()[-300:]
        result.note(f"p: ncu could not profile (exit {done.returncode}; {why}): torch.profiler instead")
        return False
    table = {}
    for row in csv_rows(done.stdout):
        kernel = row.get("Kernel Name", "?")[:70]
        metric = (row.get("Metric Name") or "").lower()
        values = table.setdefault(kernel, {"launches": set()})
        values["launches"].add(row.get("ID"))
        for key, title in METRICS:
            if key in metric:
                values[title] = f"{row.get('Metric Value')} {row.get('Metric Unit', '')}".strip()
    rows = [[kernel, len(values["launches"]), *[values.get(title, "-") for _, title in METRICS]]
            for kernel, values in table.items()]
    result.table("p: Nsight Compute, per kernel (one optimizer step over 256M elements each; the last launch's "
                 "counters where a step takes several)", ["kernel", "launches", *[title for _, title in METRICS]],
                 rows)
    result.check("p: Nsight Compute profiled the kernels", bool(rows), f"{len(rows)} kernels", ">= 1")
    stalls = subprocess.run([ncu, "--csv", "--page", "raw", "--kernel-name", "regex:fused_step_kernel",
                             "--launch-count", "2", "--metrics", STALLS, *child], capture_output=True, text=True,
                            timeout=args.child_timeout)
    found = {}
    for row in csv_rows(stalls.stdout):
        kernel = row.get("Kernel Name", "?")[:70]
        for metric, value in row.items():
            reason = (metric or "").replace("smsp__average_warps_issue_stalled_", "").replace(
                "_per_issue_active.ratio", "")
            if metric and metric.startswith("smsp__average_warps_issue_stalled_") and number(value) is not None:
                found.setdefault(kernel, []).append((reason, number(value)))
    if not found:
        result.note(f"p: ncu gave no stall breakdown (exit {stalls.returncode}: "
                    f"{(stalls.stderr or stalls.stdout).strip()[-300:]})")
    result.table("p: where the fused kernels' warps wait: cycles per issued instruction by stall reason (ncu)",
                 ["kernel", "top stall reasons (cycles / issued instruction)"],
                 [[kernel, "; ".join(f"{r} {v:.2f}" for r, v in sorted(pairs, key=lambda p: -p[1])[:6])]
                  for kernel, pairs in found.items()])
    return True


def csv_rows(text: str) -> list:
    """The rows of ncu's --csv output (its own log lines dropped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def number(value):
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return None


def resource_usage(result) -> None:
    """Registers, shared memory, stack of the fused kernels as built (cuobjdump on the loaded extension)."""
    from deepspeed_bnb.ops import loader
    binary = shutil.which("cuobjdump") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/cuobjdump"))), None)
    where = loader.built_file()
    if binary is None or not where:
        result.note("p: cuobjdump or the built extension not found: no resource usage")
        return
    done = subprocess.run([binary, "-res-usage", where], capture_output=True, text=True)
    lines = [line.strip() for line in done.stdout.splitlines() if "fused_step_kernel" in line or "REG:" in line]
    pairs = [(lines[i], lines[i + 1]) for i in range(len(lines) - 1) if "Function" in lines[i]]
    result.table("p: the fused kernels as built (cuobjdump -res-usage)", ["kernel", "usage"],
                 [[name.split(":")[-1][:90], usage] for name, usage in pairs][:24])


def body(args, result):
    if args.under_ncu or args.torch_profile:
        child(args, result)
        return
    from deepspeed_bnb.ops import loader
    result.check("p: the fused kernels load", loader.load(verbose=False), loader.source() or loader.error(), "loaded")
    if args.device == "cuda":
        resource_usage(result)
        if ncu_profile(args, result):
            return
    path = os.path.join(args.work, "profile_torch.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--result", path, "--work", args.work,
           "--bundle", args.bundle, "--torch-profile"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
    if not os.path.isfile(path):
        result.check("p: torch.profiler ran", False, f"exit code {done.returncode}", "ran")
        return
    import json
    with open(path) as f:
        found = json.load(f)
    result.data["tables"] += found["tables"]
    result.data["checks"] += found["checks"]


def extra(parser):
    parser.add_argument("--under-ncu", action="store_true", help="the process ncu profiles")
    parser.add_argument("--torch-profile", action="store_true", help="the process torch.profiler profiles")
    parser.add_argument("--child-timeout", type=float, default=240)


if __name__ == "__main__":
    common.run_part("p", "a profile of one optimizer step over 256M elements", body, extra)
