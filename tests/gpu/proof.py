"""The GPU proof: one command that shows, on a GPU machine, what users of deepspeed_bnb get there; rehearsed on the CPU.

On a machine with a GPU (prepare .device/ on a machine with network access first and carry it there with the
checkout; see DEVELOPERS.md), from the repository root:
    python3 tests/gpu/proof.py --out OUT [--parts a,b+c]
It installs DeepSpeed and the trimmed bitsandbytes from .device/ (proof_bundle.py), runs each part below in a child
process of its own under one deadline (default 450 s on a GPU, none in the rehearsal: the parts are ordered by what
they prove, and one that no longer fits is reported as not run), and writes into OUT: report.md and report.json
(every check with what it measured and its bar), proof.log (every child's output) and gpu_checkpoint.tar (part d's
checkpoint, which tests/gpu/test_gpu_proof.py loads at DP 2 on CPU ranks once it is committed under
benchmarks/results/gpu/).

Here:
    .venv/bin/python tests/gpu/proof.py --prepare                    # build .device/ (needs the network; ~1 min)
    .venv/bin/python tests/gpu/proof.py --dry-run --out /tmp/proof   # the rehearsal on the CPU: make test runs it
    VENV/bin/python tests/gpu/proof.py --dry-run --install --out /tmp/proof   # also the install, in a venv like
                                          # the machine's (Python 3.12, torch 2.11, no DeepSpeed or bitsandbytes)

Parts (each a script beside this one; its docstring says what it proves and against what):
    env  part_environment.py   the machine, the versions, the packages import
    a    part_kernels.py       fused kernels == their oracles on the device (the reference; bnb's own CUDA update);
                               first-use check
    k    part_variants.py     the kernels in several launch shapes, each == bnb's own CUDA update, timed side by side
    b+c  part_engines.py       ZeRO-1/2/3 x fp32/bf16 == plain bnb AdamW8bit, bnb's update and the fused kernel; the
                               fused kernel against bnb's update from the same state
    d    part_checkpoints.py   a CPU checkpoint continues on the device; the device's checkpoint comes back
    e    part_large.py         a parameter of 2^31 + 4096 elements steps correctly on both paths
    f    part_speed.py         ZeRO-2 step time and engine.step() at 125M and 1B, configurations interleaved; host
                               syncs; the kernels' bandwidth over 256M elements
    f3   part_speed.py         the same at 1B under ZeRO-3 and with the optimizer offloaded to the CPU
    s    part_step.py          engine.step() at 1B taken apart and profiled: DeepSpeed's parts, device busy time,
                               launches, syncs; DeepSpeed's fp64 gradient norm against ways without its copy
    s3   part_step.py          the same for ZeRO-3's engine.step() at 1B (its own parts; no per-piece norm)
    so   part_step.py          the same for ZeRO-2 with the optimizer offloaded to the CPU at 1B (part f3's rows)
    m    part_memory.py        peak memory from fresh processes at two sizes; the closed form; the largest GPT on 80 GB
    p    part_profile.py       Nsight Compute (or torch.profiler) of one step over 256M elements: bandwidth, occupancy,
                               registers, stall reasons
    o    part_offload.py       the host's offloaded step on every core: the 8-bit kernel against DeepSpeedCPUAdam
    g    part_zero_features.py ZenFlow, SuperOffload, Twin-Flow as stock DeepSpeed runs them; deepspeed_bnb refuses them
    h    part_nvme.py          ZeRO-3 with the optimizer on NVMe == CPU offload, bit for bit; its checkpoint resumes
The rehearsal (--dry-run) runs the same parts on the CPU with gloo; its stand-ins are named in each part's docstring
(bnb_fused_kernel false for the GPU's "auto", small sizes for e and f).
"""

import argparse
import datetime
import glob
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import proof_common as common
import proof_report
from support import prebuild, process_tree

TIME_FORMAT = "%Y-%m-%d %H:%M UTC"


@dataclass(frozen=True)
class Part:
    name: str  # the report's label
    script: str  # beside this file
    budget: float  # seconds it may take on one H100, JIT builds included (the deadline may leave it less)
    args: tuple = ()  # extra arguments of the script


PARTS = (Part("env", "part_environment.py", 90), Part("a", "part_kernels.py", 300), Part("k", "part_variants.py", 240),
         Part("b+c", "part_engines.py", 240),
         Part("d", "part_checkpoints.py", 120), Part("e", "part_large.py", 300),
         Part("f", "part_speed.py", 300, ("--suite", "f")), Part("f3", "part_speed.py", 300, ("--suite", "f3")),
         Part("s", "part_step.py", 200), Part("s3", "part_step.py", 150, ("--stage", "3")),
         Part("so", "part_step.py", 150, ("--offload",)),
         Part("m", "part_memory.py", 300), Part("p", "part_profile.py", 200), Part("o", "part_offload.py", 280),
         Part("g", "part_zero_features.py", 180), Part("h", "part_nvme.py", 240))
GPU_DEADLINE = 450  # seconds for the whole proof on a GPU by default: with the install, it fits a 10-minute job
# The rehearsal has no overall deadline by default: it runs inside the suite, where a busy machine (another job on the
# same cores, a first JIT build of DeepSpeed's ops) may make it several times slower; a wall-clock bar would then fail
# the suite for the machine's load, not for the code. Each part and the up-front builds stay bounded by their own
# budgets (GPU-sized, many times a part's CPU time), so a hung part still ends and is reported.
# On the CPU rehearsal a part's budget is only a hang guard: a machine shared with other jobs slows the parts far more
# than their CPU time suggests (measured: parts p and o past their budgets, 200 s and 240 s, while two other test
# suites ran on the same 2 cores; idle they take 6 s and 7 s)
DRY_RUN_BUDGET_FACTOR = 3
MIN_START = 20  # seconds of the deadline a part needs left to be started
RESERVE = 10  # seconds kept for writing the report
BUILD_BUDGET = 900  # seconds the up-front builds may take (two busy CPU cores build DeepSpeed's async_io in minutes)
# DeepSpeed's own ops the parts load (on the CPU rehearsal and on a GPU), built up front with deepspeed_bnb's kernels,
# so that no part spends its deadline on a build, and none is killed at its deadline mid-build
PART_OPS = {"cpu": {"a": ("ShareMemCommBuilder",), "b+c": ("ShareMemCommBuilder",), "f": ("FusedAdamBuilder",),
                    "f3": ("CPUAdamBuilder",), "m": ("FusedAdamBuilder",), "o": ("CPUAdamBuilder",),
                    "h": ("AsyncIOBuilder",)},
            "cuda": {"f": ("FusedAdamBuilder",), "f3": ("CPUAdamBuilder",), "m": ("FusedAdamBuilder",),
                     "o": ("CPUAdamBuilder",)}}  # a GPU's async_io builds in part h, against the bundle's libaio


def cuda_home():
    """Where the CUDA headers are, when torch's own guess (the folder above the `nvcc` on PATH) has none: nvcc may be
    a wrapper in /usr/local/bin (as on this project's CPU machines), and torch then looks in /usr/local/include."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return None
    nvcc = shutil.which("nvcc")
    if nvcc and os.path.isfile(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include", "cuda_runtime.h")):
        return None
    found = sorted(glob.glob("/usr/local/cuda*/include/cuda_runtime.h"))
    return os.path.dirname(os.path.dirname(found[-1])) if found else None


def build_flags():
    """deepspeed_bnb/ops/build_flags.py, loaded without the package (whose imports come with the bundle, later)."""
    spec = importlib.util.spec_from_file_location("build_flags", os.path.join(common.ROOT, "deepspeed_bnb", "ops",
                                                                              "build_flags.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child_env(pythonpath, extensions: str) -> dict:
    env = common.without_launch_vars()
    home = cuda_home()
    if home:
        env["CUDA_HOME"] = home
    # tests/support/site: a JIT build lock left by a part killed at its deadline cannot hang a later one
    # (tests/support/jit_guard.py); the suite's own runs have it already
    guard = os.path.join(common.TESTS, "support", "site")
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*pythonpath, common.ROOT, guard, *filter(None, env.get(
        "PYTHONPATH", "").split(os.pathsep))]))
    env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    if extensions:
        env["TORCH_EXTENSIONS_DIR"] = extensions  # a fresh JIT cache: no lock left by another run can hang us
    return env


def run_child(cmd, env: dict, timeout: float, log) -> int:
    """Run `cmd` in a session of its own, its output into `log`; on timeout kill the whole session (its children,
    ninja and the compilers included: tests/support/process_tree.py). Returns its exit code, or None when it timed
    out."""
    log.flush()
    return process_tree.run(cmd, timeout, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=common.ROOT).returncode


def part_result(part: Part, path: str, code, seconds: float, log_path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    why = "timed out" if code is None else f"exit code {code}"
    return {"part": part.name, "title": part.script, "ok": False, "checks": [], "tables": [], "notes": [],
            "seconds": round(seconds, 1), "error": f"the part wrote no result ({why}); the end of proof.log:\n{tail}"}


def save(report: dict, out: str) -> None:
    common.write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(proof_report.render(report))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="build the bundle (.device/) here and stop")
    parser.add_argument("--dry-run", action="store_true", help="the rehearsal: the CPU, the venv's packages")
    parser.add_argument("--install", action="store_true",
                        help="with --dry-run: install DeepSpeed and bitsandbytes from the bundle as on the GPU machine "
                             "(rehearses the install in a venv without them, e.g. Python 3.12 with torch 2.11)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where the report goes (default: the OUT "
                        "environment variable)")
    parser.add_argument("--work", help="scratch folder (default: a new temporary one)")
    parser.add_argument("--bundle", default=os.path.join(common.ROOT, ".device"))
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"seconds for the whole proof (default: {GPU_DEADLINE} on a GPU; none in the rehearsal)")
    parser.add_argument("--parts", default=",".join(p.name for p in PARTS), help="comma-separated part names")
    parser.add_argument("--cuda-shape", default="", help="a candidate launch shape for every rule's product CUDA "
                        "kernels, Tuning's seven arguments (e.g. 3,true,false,1,true,false,true: csrc/cuda/"
                        "fused_step.cuh); every part then runs on a build with it (DEEPSPEED_BNB_CUDA_SHAPE), part k's "
                        "sweep excepted (it builds its shapes itself). Default: each rule's own shape")
    args = parser.parse_args()
    if args.cuda_shape:  # checked here: a typo ends the run before any build (build_flags.py says what is wrong)
        flags = build_flags()
        try:
            flags.cuda_shape_flags(args.cuda_shape)
        except ValueError as exc:
            sys.exit(f"proof.py --cuda-shape: {exc}")
        os.environ[flags.CUDA_SHAPE_ENV] = args.cuda_shape  # the children's environment is this one's
    if args.prepare:
        import proof_bundle
        print(json.dumps(proof_bundle.prepare(args.bundle), indent=1))
        return
    start = time.monotonic()
    deadline = args.deadline if args.deadline is not None else (math.inf if args.dry_run else GPU_DEADLINE)
    if not args.out:
        sys.exit("proof.py: say where the report goes (--out DIR, or the OUT environment variable)")
    os.makedirs(args.out, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="dsbnb_gpu_proof_")
    os.makedirs(work, exist_ok=True)
    device = "cpu" if args.dry_run else "cuda"
    report = {"device": "CPU rehearsal (stand-ins for the GPU)" if args.dry_run else "GPU (named in part env)",
              "mode": "dry run" if args.dry_run else "GPU", "command": " ".join(sys.argv),
              "started": datetime.datetime.now(datetime.timezone.utc).strftime(TIME_FORMAT),
              "deadline": deadline if math.isfinite(deadline) else None, "seconds": 0.0, "install": None,
              "builds": None, "parts": []}
    log_path = os.path.join(args.out, "proof.log")
    bundle, pythonpath, extensions = args.bundle, [], None
    with open(log_path, "a") as log:
        if not args.dry_run or args.install:
            import proof_bundle
            try:
                report["install"] = proof_bundle.install(bundle, os.path.join(work, "site"))
                pythonpath = report["install"]["pythonpath"]
            except Exception as exc:
                report["install"] = {"error": f"{type(exc).__name__}: {exc}"}
                report["parts"].append({"part": "install", "title": "install the bundle", "ok": False, "checks": [],
                                        "tables": [], "notes": [], "seconds": None, "error": str(exc)})
                save(report, args.out)
                sys.exit(f"proof.py: the bundle could not be installed: {exc}")
            extensions = os.path.join(work, "torch_extensions")
        env = child_env(pythonpath, extensions)
        if args.dry_run and not os.path.isdir(os.path.join(bundle, "cpu_checkpoint")):
            import proof_bundle
            bundle = os.path.join(work, "bundle")
            proof_bundle.cpu_checkpoint(bundle, env=env)
        # every JIT build the parts need, once, before anything with a deadline: a part then only loads
        chosen = args.parts.split(",")
        ops = sorted({op for name in chosen for op in PART_OPS[device].get(name, ())}
                     - (set() if os.path.isfile("/usr/include/libaio.h") or not args.dry_run else {"AsyncIOBuilder"}))
        build_env = dict(env)
        if env.get("TORCH_CUDA_ARCH_LIST"):  # DeepSpeed's builder cannot parse "9.0a" (proof_common)
            build_env["TORCH_CUDA_ARCH_LIST"] = common.deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
        print(f"--- up-front builds: deepspeed_bnb's kernels, {', '.join(ops) or 'no DeepSpeed op'}", file=log,
              flush=True)
        began = time.monotonic()
        code = run_child([sys.executable, "-c", prebuild.BUILD, *ops], build_env,
                         min(BUILD_BUDGET, deadline - RESERVE), log)
        report["builds"] = {"ops": ["deepspeed_bnb kernels", *ops], "seconds": round(time.monotonic() - began, 1),
                            "exit": "timed out" if code is None else code}
        for part in (p for p in PARTS if p.name in args.parts.split(",")):
            left = deadline - (time.monotonic() - start) - RESERVE
            if left < MIN_START:
                report["parts"].append({"part": part.name, "title": part.script, "ok": False, "checks": [],
                                        "tables": [], "notes": [], "seconds": None, "error": None,
                                        "skipped": f"{left:.0f} s of the deadline left"})
                continue
            result = os.path.join(work, f"{part.name}.json")
            cmd = [sys.executable, os.path.join(common.GPU, part.script), "--device", device, "--result", result,
                   "--work", work, "--bundle", bundle, "--out", args.out, *part.args]
            budget = part.budget * (DRY_RUN_BUDGET_FACTOR if args.dry_run else 1)
            print(f"--- part {part.name} ({part.script}), at most {min(budget, left):.0f} s", file=log,
                  flush=True)
            began = time.monotonic()
            code = run_child(cmd, env, min(budget, left), log)
            found = part_result(part, result, code, time.monotonic() - began, log_path)
            report["parts"].append(found)
            report["seconds"] = time.monotonic() - start
            save(report, args.out)
            failed = [c["name"] for c in found["checks"] if not c["ok"]]
            print(f"part {part.name}: {proof_report.verdict(found)} in {found.get('seconds')} s"
                  + "".join(f"\n    FAIL {name}" for name in failed)
                  + (f"\n    error: {found['error'].strip().splitlines()[-1]}" if found["error"] else ""),
                  flush=True)
    report["seconds"] = time.monotonic() - start
    save(report, args.out)
    ok = all(p["ok"] for p in report["parts"])
    print(f"GPU proof ({report['mode']}): {'every part holds' if ok else 'NOT every part holds'}; "
          f"{report['seconds']:.0f} s; report in {os.path.join(args.out, 'report.md')}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
