"""DeepSpeed's own unit tests as an outside check: each test id run as DeepSpeed wrote it and with every Adam/AdamW
replaced by bitsandbytes' AdamW8bit under deepspeed_bnb, side by side, each run in a session of its own with a
deadline (a hang in DeepSpeed's harness is reported as such and killed with its workers, not waited on).

    python tools/deepspeed_unit_tests.py --tests DEEPSPEED/tests --python PYTHON --out REPORT.md ID [ID ...]

DEEPSPEED/tests: the tests folder of a DeepSpeed checkout (its unit tests import `unit.*` from there); PYTHON: an
interpreter with deepspeed, bitsandbytes, deepspeed_bnb's dependencies and pytest < 8.4 (DeepSpeed's harness needs
it); ids as pytest takes them, relative to DEEPSPEED/tests (explicit ids: the harness spawns workers per id). Runs on
CPU ranks (DS_ACCELERATOR=cpu). The replacement is tools/deepspeed_unit_tests_site/sitecustomize.py: it logs every
engine's ZeRO and base optimizer classes, so the report shows that the bnb runs did step AdamW8bit under deepspeed_bnb
(a run that built no such engine is flagged: it tested nothing of ours). Results: docs/deepspeed_unit_tests.md.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.path.join(ROOT, "tools", "deepspeed_unit_tests_site")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from support import process_tree  # noqa: E402  (a child killed with its whole session at its deadline)

MODES = ("stock", "bnb")
OURS = ("BnbZeroOptimizer", "BnbZeroStage3Optimizer")


def _teardown():
    """deepspeed_bnb/utils/teardown.py loaded by its path: it needs only the standard library, and importing it as
    part of the package would run the package's __init__ (DeepSpeed's overrides) in this driver, which may lack
    DeepSpeed."""
    spec = importlib.util.spec_from_file_location("_dsbnb_teardown", os.path.join(ROOT, "deepspeed_bnb", "utils",
                                                                                  "teardown.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# DeepSpeed's CPU comm op leaves a 66 MB buffer per rank in /dev/shm that it never unlinks; swept after each run
sweep_shm_buffers = _teardown().sweep_shm_buffers


def run_one(test_id: str, mode: str, args, log_dir: str) -> dict:
    """One pytest run of `test_id` in `mode`: its outcome, the first error line, the engines it built, seconds."""
    log = os.path.join(log_dir, f"{len(os.listdir(log_dir))}.jsonl")
    # LOCAL_SIZE: the CPU accelerator's device count, which DeepSpeed's harness compares with a test's world size
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE=str(args.devices), DEEPSPEED_BNB_UNIT_MODE=mode,
               DEEPSPEED_BNB_UNIT_LOG=log,
               PYTHONPATH=os.pathsep.join([SITE, ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(
                   os.pathsep))]))
    env.pop("LOCAL_RANK", None)
    since, began = time.time(), time.monotonic()
    done = process_tree.run([args.python, "-m", "pytest", "-q", "-x", "--color=no", "-p", "no:cacheprovider", test_id],
                            args.timeout, env=env, cwd=args.tests, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seconds = time.monotonic() - began
    sweep_shm_buffers(since)
    output = re.sub(r"\x1b\[[0-9;]*m", "", (done.stdout or "") + (done.stderr or ""))  # DeepSpeed's pytest.ini colors
    engines = []
    if os.path.isfile(log):
        with open(log) as f:
            engines = [json.loads(line) for line in f if line.strip()]
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\b(passed|failed|skipped|error)",
                                                                              line)), "")
    if done.returncode is None:
        outcome = "hung"
    elif done.returncode == 0:
        outcome = "skipped" if "skipped" in summary and "passed" not in summary else "passed"
    else:
        outcome = "failed"
    # the first line pytest marks as the error (E), preferring one that names an exception
    marked = [line[1:].strip() for line in output.splitlines() if line.startswith("E ")]
    error = next((line for line in marked if re.search(r"\w+(Error|Exception)\b", line)), marked[0] if marked else "")
    return {"id": test_id, "mode": mode, "outcome": outcome, "error": error[:300], "seconds": round(seconds, 1),
            "engines": len(engines), "ours": sum(e["zero_optimizer"] in OURS and e["base_optimizer"] == "AdamW8bit"
                                                 for e in engines)}


def render(results: list, args) -> str:
    rows = {}
    for r in results:
        rows.setdefault(r["id"], {})[r["mode"]] = r
    lines = [f"Command: `python tools/deepspeed_unit_tests.py --tests {args.tests} ...` ({len(rows)} ids, "
             f"deadline {args.timeout:.0f} s per run)", "",
             "| id | stock | bnb + deepspeed_bnb | engines (bnb: of ours over AdamW8bit) | bnb's first error |",
             "|---|---|---|---|---|"]
    for test_id, modes in rows.items():
        stock, bnb = modes.get("stock", {}), modes.get("bnb", {})
        flag = "" if not bnb or bnb["engines"] == 0 or bnb["ours"] == bnb["engines"] else " (not all ours!)"
        lines.append(f"| `{test_id}` | {stock.get('outcome', '-')} | {bnb.get('outcome', '-')} | "
                     f"{stock.get('engines', '-')} / {bnb.get('engines', '-')} ({bnb.get('ours', '-')}){flag} | "
                     f"{bnb.get('error', '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", required=True, help="the tests folder of a DeepSpeed checkout")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs them (pytest < 8.4)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as hung")
    parser.add_argument("--out", required=True, help="the markdown report (a .json beside it holds every run)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--devices", type=int, default=4, help="CPU 'devices' the harness sees (LOCAL_SIZE)")
    parser.add_argument("ids", nargs="+")
    args = parser.parse_args()
    # the runs start in the tests folder: a relative interpreter path would name another file there
    given = args.python
    args.python = shutil.which(given) if os.sep not in given else os.path.abspath(given)
    version = subprocess.run([args.python, "-c", "import pytest; print(pytest.__version__)"],
                             capture_output=True, text=True) if args.python else None
    if version is None or version.returncode != 0 or not re.match(r"\d+\.\d+", version.stdout):
        why = "not found" if version is None else (version.stderr.strip().splitlines() or ["no pytest"])[-1][:200]
        sys.exit(f"deepspeed_unit_tests: --python {given} does not run pytest ({why}): pass an interpreter with "
                 f"pytest < 8.4 and DeepSpeed installed")
    if tuple(int(x) for x in re.findall(r"\d+", version.stdout)[:2]) >= (8, 4):
        sys.exit(f"deepspeed_unit_tests: {given} has pytest {version.stdout.strip()}; DeepSpeed's unit tests need "
                 f"pytest < 8.4 (its DistributedTest harness breaks on later releases): pass another interpreter "
                 f"(--python), e.g. a venv with `pip install 'pytest<8.4'`")
    if not os.path.isdir(os.path.join(args.tests, "unit")):
        sys.exit(f"deepspeed_unit_tests: {args.tests} has no unit/ folder: pass the tests folder of a DeepSpeed "
                 f"checkout (git clone https://github.com/deepspeedai/DeepSpeed; --tests DeepSpeed/tests)")
    results = []
    with tempfile.TemporaryDirectory(prefix="dsbnb_unit_") as log_dir:
        for test_id in args.ids:
            for mode in args.modes.split(","):
                results.append(run_one(test_id, mode, args, log_dir))
                r = results[-1]
                print(f"{r['outcome']:8} {mode:5} {r['seconds']:6.1f}s engines {r['engines']} (ours {r['ours']}) "
                      f"{test_id} {r['error'][:120]}", flush=True)
                with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                    json.dump(results, f, indent=1)
                with open(args.out, "w") as f:
                    f.write(render(results, args))


if __name__ == "__main__":
    main()
