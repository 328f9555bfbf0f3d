"""What every part of the GPU proof shares: paths, arguments, the one-rank process group, determinism, the result file.

A part is a script run by proof.py in a child process of its own (a CUDA error, an out-of-memory or a hang ends that
part only). It writes one JSON result: checks (each with what was measured, the bar and whether it held), tables and
notes; proof.py turns the results into the report. `--device cuda` is the proof; `--device cpu` is its rehearsal
on a machine without a GPU (the same code, gloo instead of NCCL, stand-ins where only a GPU has the thing).
"""

import argparse
import contextlib
import json
import os
import re
import sys
import time
import traceback
from typing import Callable, List, Optional

GPU = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(GPU)
ROOT = os.path.dirname(TESTS)
for folder in (ROOT, TESTS, os.path.join(ROOT, "benchmarks")):
    if folder not in sys.path:
        sys.path.append(folder)  # after site-packages: a test helper must not shadow an installed package
from conftest import free_port, without_launch_vars  # noqa: E402,F401  (the suite's own, re-exported for the parts)


@contextlib.contextmanager
def environment(settings: dict):
    """`settings` in os.environ inside, the values before restored after."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parse_args(description: str, extra: Optional[Callable] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--result", required=True, help="the part's JSON result file")
    parser.add_argument("--work", required=True, help="a scratch folder of this part")
    parser.add_argument("--bundle", default=os.path.join(ROOT, ".device"), help="what traveled (bundle.py)")
    parser.add_argument("--out", default=None, help="the folder whose files come back from the GPU machine")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


class Result:
    """One part's findings: checks (the proof), tables and notes (what it measured), in the order they were made."""

    # what a result written by checkpoint() says, until the part's end replaces it
    UNFINISHED = "the part stopped before its end (its deadline or a crash): what it had finished is shown"

    def __init__(self, part: str, title: str, device: str, path: Optional[str] = None):
        self.data = {"part": part, "title": title, "device": device, "ok": None, "checks": [], "tables": [],
                     "notes": [], "seconds": None, "error": None}
        self.path = path  # the result file (run_part writes it at the end; checkpoint() before)
        self.started = time.monotonic()

    def checkpoint(self) -> None:
        """Write what the part has found so far as the result of a part that stopped here, not holding. proof.py
        kills a part at its deadline (the whole process: nothing of the part runs then), so a part with several
        long stages calls this after each: a deadline then costs the stage it interrupted, not what came before.
        run_part's own write at the end replaces it."""
        if self.path:
            write_json(self.path, {**self.data, "ok": False, "error": self.UNFINISHED,
                                   "seconds": round(time.monotonic() - self.started, 1)})

    def check(self, name: str, ok: bool, measured, bar: str, note: str = "") -> bool:
        """One claim: `measured` against `bar`, held or not (recorded either way; the part fails if any fails)."""
        self.data["checks"].append({"name": name, "ok": bool(ok), "measured": measured, "bar": bar, "note": note})
        print(f"[{self.data['part']}] {'ok  ' if ok else 'FAIL'} {name}: {measured} (bar: {bar})", flush=True)
        return bool(ok)

    def table(self, title: str, columns: List[str], rows: List[list]) -> None:
        self.data["tables"].append({"title": title, "columns": columns, "rows": rows})

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"[{self.data['part']}] note: {text}", flush=True)


# What run_part does before its os._exit, which skips atexit handlers: one_rank's release of DeepSpeed's CPU comm buffer
AT_EXIT: List[Callable[[], None]] = []


def run_part(part: str, title: str, body: Callable[[argparse.Namespace, Result], None],
             extra: Optional[Callable] = None) -> None:
    """Parse the arguments, run `body(args, result)`, write the result (also when it raised) and exit 0 when every
    check held and at least one was made."""
    args = parse_args(title, extra)
    result = Result(part, title, args.device, args.result)
    start = result.started
    try:
        body(args, result)
    except BaseException as exc:  # the report says what broke; the orchestrator goes on with the next part
        result.data["error"] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-6000:]
        print(result.data["error"], file=sys.stderr, flush=True)
    checks = result.data["checks"]
    result.data["ok"] = result.data["error"] is None and bool(checks) and all(c["ok"] for c in checks)
    result.data["seconds"] = round(time.monotonic() - start, 1)
    write_json(args.result, result.data)
    for release in AT_EXIT:
        release()
    sys.stdout.flush()
    os._exit(0 if result.data["ok"] else 1)  # no interpreter teardown: NCCL/gloo groups can abort there


def deepspeed_arch_list(value: Optional[str]) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT builder can read it. DeepSpeed 0.19.8 parses each entry's minor version
    as an integer, so an arch-specific entry such as "9.0a" (which torch's builder accepts, and which GPU images set
    for Hopper) fails with "invalid literal for int() with base 10: '0a'": drop the suffix, keep "+PTX"."""
    if not value:
        return value
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def write_json(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def one_rank(device: str):
    """deepspeed.comm as rank 0 of 1: NCCL on a GPU, gloo on the CPU."""
    import deepspeed
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)
    from deepspeed_bnb.utils.teardown import release_shm_buffer
    AT_EXIT.append(lambda: release_shm_buffer(0))  # DeepSpeed's CPU comm op leaves its buffer in /dev/shm otherwise


def deterministic(device: str) -> None:
    """The same inputs give the same bits: deterministic kernels, no TF32 (cuBLAS would round fp32 products to 10
    mantissa bits, and an engine and its reference could pick different algorithms)."""
    import torch
    torch.use_deterministic_algorithms(True, warn_only=True)
    # deterministic mode also fills every torch.empty with NaN: DeepSpeed's 2 GB gradient buckets would cost seconds
    torch.utils.deterministic.fill_uninitialized_memory = False
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(0)


def max_abs(a, b) -> float:
    """Largest |a - b| over two tensors (or lists of them), in float64 on the CPU."""
    import torch
    if isinstance(a, (list, tuple)):
        return max((max_abs(x, y) for x, y in zip(a, b)), default=0.0)
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max()) if a.numel() else 0.0
