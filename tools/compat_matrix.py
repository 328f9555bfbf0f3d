"""Compatibility matrix: this repository's core correctness tests against DeepSpeed x bitsandbytes releases.

Each cell gets a throwaway venv (under a temp dir, deleted afterwards) holding the local CPU build of torch
(`torch==2.13.0`, never an unpinned torch), DeepSpeed built from its sdist (`DS_BUILD_OPS=0`, no CUDA) and
bitsandbytes, both from the package index; pip's own cache keeps downloads and built wheels across cells and runs.
The repository's tests then run in that venv with PYTHONPATH at the repository root (so this checkout's deepspeed_bnb
and tests are the ones run) and DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS=1 (so the import guard lets every cell run).

Results are merged into tools/compat_matrix.json cell by cell (a rerun of one cell replaces that cell only) and
rendered as the table in tools/compat_matrix.md, with a failure excerpt per failing claim. Run by hand; not part of
`make test` (about an hour on 2 cores). Full logs go to ~/.cache/deepspeed_bnb/compat_matrix/.

  tools/compat_matrix.sh                                           # every default cell
  tools/compat_matrix.sh --only deepspeed==0.18.9                  # the cells with that release
  tools/compat_matrix.sh --only "deepspeed==0.19.7 bitsandbytes==0.49.2"  # one cell (also one outside the defaults)
  tools/compat_matrix.sh --resume                                  # skip cells already in the results
  tools/compat_matrix.sh --list                                    # the selected cells, without running them
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_JSON = os.path.join(REPO, "tools", "compat_matrix.json")
RESULTS_MD = os.path.join(REPO, "tools", "compat_matrix.md")
LOG_DIR = os.path.join(os.path.expanduser("~"), ".cache", "deepspeed_bnb", "compat_matrix")
ALLOW_UNTESTED_ENV = "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"  # deepspeed_bnb/_versions.py (not importable here)

TORCH = "torch==2.13.0"  # the CPU build pip finds on this machine's disk; an unpinned torch pulls a CUDA build
# setup.py's install_requires besides torch, deepspeed and bitsandbytes, plus what the tests and the sdist build need
EXTRA_PACKAGES = ("ninja", "packaging", "safetensors", "pytest")
BUILD_PACKAGES = ("setuptools", "wheel")  # DeepSpeed's sdist is built without isolation, against the pinned torch

BNB_CURRENT, BNB_PREVIOUS = "0.50.2", "0.49.2"
DS_SERIES, DS_PREVIOUS_SERIES = (0, 19), (0, 18)

# claim (table column) -> the test ids that establish it; each test carries its own negative control
CLAIMS = {
    "sharded == unsharded": ["tests/test_sharded_update.py"],
    "DP=1 == plain bnb": ["tests/test_matches_bnb.py::test_zero_dp1_matches_plain_bnb",
                          "tests/test_matches_bnb.py::test_control_stock_zero_differs_from_plain_bnb"],
    "elastic 2->1, 1->2": [f"tests/test_elastic.py::test_load_at_any_dp[{kind}-{saved}-{loaded}]"
                           for kind in ("fp32_stage1", "bf16_stage2") for saved, loaded in ((2, 1), (1, 2))],
    "same-DP resume": [f"tests/test_distributed.py::test_same_dp_resume_is_bit_exact[{case}-2]"
                       for case in ("stage1_rigid", "stage1_elastic", "stage2_rigid", "stage2_elastic")],
}
CLAIM_TIMEOUT = 1800  # seconds of pytest per claim: a hung gloo group must not stall the whole matrix


def release(text: str):
    """(0, 19, 8) for a final release "0.19.8", None for pre-releases and anything else."""
    return tuple(int(part) for part in text.split(".")) if re.fullmatch(r"\d+(\.\d+)*", text) else None


def index_releases(python: str, package: str):
    done = subprocess.run([python, "-m", "pip", "index", "versions", package], capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("Available versions:")), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"compat_matrix: `pip index versions {package}` failed (pip >= 21.2 needed, and the package index "
                 f"reachable):\n{done.stdout}{done.stderr}")
    return sorted((v.strip() for v in line.split(":", 1)[1].split(",") if release(v.strip())), key=release)


def default_cells(python: str):
    """Every DeepSpeed 0.19.x with the current bitsandbytes; the newest 0.18.x and 0.19.x with the previous one."""
    deepspeed = index_releases(python, "deepspeed")
    series = [v for v in deepspeed if release(v)[:2] == DS_SERIES]
    previous = [v for v in deepspeed if release(v)[:2] == DS_PREVIOUS_SERIES]
    return [(v, BNB_CURRENT) for v in series] + [(previous[-1], BNB_PREVIOUS), (series[-1], BNB_PREVIOUS)]


def parse_only(text: str) -> dict:
    """"deepspeed==0.19.7 bitsandbytes==0.49.2" -> {"deepspeed": "0.19.7", "bitsandbytes": "0.49.2"}."""
    wanted = {}
    for term in text.replace(",", " ").split():
        package, sep, version = term.partition("==")
        if not sep or package not in ("deepspeed", "bitsandbytes") or not release(version):
            sys.exit(f"compat_matrix: --only {text!r}: {term!r} is not deepspeed==X.Y.Z or bitsandbytes==X.Y.Z")
        wanted[package] = version
    return wanted


def select(cells, only):
    """The cells matching any --only (all its terms); a --only naming both packages is a cell of its own."""
    if not only:
        return cells
    chosen = []
    for wanted in map(parse_only, only):
        matching = [(d, b) for d, b in cells if wanted.get("deepspeed", d) == d and wanted.get("bitsandbytes", b) == b]
        if not matching and len(wanted) == 2:
            matching = [(wanted["deepspeed"], wanted["bitsandbytes"])]
        if not matching:
            sys.exit(f"compat_matrix: --only {' '.join(f'{k}=={v}' for k, v in wanted.items())} matches no cell; "
                     f"name both packages to run a cell outside the default list")
        chosen += [c for c in matching if c not in chosen]
    return chosen


def clean_env(**extra) -> dict:
    """This environment without another venv's or checkout's paths, plus `extra`."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", ALLOW_UNTESTED_ENV)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(PYTHONNOUSERSITE="1", **extra)
    return env


def logged(cmd, log, env, timeout=None) -> int:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        log.write(f"\ncompat_matrix: timed out after {timeout} s\n")
        return 124


def install(venv: str, deepspeed: str, bnb: str, args, log) -> str:
    """Populate `venv`; returns "" or what failed."""
    if logged([args.python, "-m", "venv", venv], log, clean_env()) != 0:
        return "python -m venv failed"
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "--progress-bar", "off"]
    torch_index = ["--index-url", args.torch_index] if args.torch_index else []
    constraints = os.path.join(venv, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(TORCH + "\n")  # nothing below may swap the local torch build for another
    env = clean_env(DS_BUILD_OPS="0")  # DeepSpeed's setup.py: JIT ops only, no CUDA needed
    if logged(pip + [TORCH, *BUILD_PACKAGES] + torch_index, log, env) != 0:
        return f"pip install {TORCH} failed"
    if logged(pip + ["--no-build-isolation", "-c", constraints, f"deepspeed=={deepspeed}", f"bitsandbytes=={bnb}",
                     *EXTRA_PACKAGES], log, env) != 0:
        return f"pip install deepspeed=={deepspeed} bitsandbytes=={bnb} failed"
    return ""


def installed_versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m; "
            "print(json.dumps({p: m.version(p) for p in ('deepspeed', 'bitsandbytes', 'torch')}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_env())
    return json.loads(done.stdout) if done.returncode == 0 else {}


def node_id(case) -> str:
    return case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")


def excerpt(text: str, lines: int = 4) -> str:
    """The last few distinct error lines of a failure (exception lines and failed asserts), shortened, with the
    checkout and the throwaway venv named by role rather than by path (the table is committed)."""
    text = re.sub(r"[^\s('\"]*/deepspeed_bnb_compat_\w+/venv", "<venv>", text).replace(REPO + os.sep, "")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if re.match(r"^(E\s+)?([\w.]*(Error|Exception|Interrupt)\b|assert |Failed:|ERROR:)", line):
            line = re.sub(r"^E\s+", "", line)[:300]
            if line in found:
                found.remove(line)
            found.append(line)
    return "\n".join(found[-lines:]) or text.strip()[-600:]


def claim_result(ids, junit: str, output: str, seconds: float) -> dict:
    """Outcome of one claim's pytest run: pass / fail / not run, test counts, seconds and a failure excerpt."""
    cases = list(ElementTree.parse(junit).getroot().iter("testcase")) if os.path.exists(junit) else []
    mine = [c for c in cases if any(node_id(c) == i or node_id(c).startswith((i + "::", i + "[")) for i in ids)]
    bad = [c for c in mine if c.find("failure") is not None or c.find("error") is not None
           or c.find("skipped") is not None]  # a skip would be a vacuous pass
    record = {"tests": len(mine), "failed": len(bad), "seconds": round(seconds)}
    if not mine:  # nothing collected: an import error in a test module, or a test id that no longer exists
        record.update(outcome="not run", excerpt=excerpt(output))
    elif bad:
        first = bad[0]
        problem = next(first.find(tag) for tag in ("failure", "error", "skipped") if first.find(tag) is not None)
        record.update(outcome="fail", first_failed=node_id(first),
                      excerpt=excerpt((problem.get("message") or "") + "\n" + (problem.text or "")))
    else:
        record["outcome"] = "pass"
    return record


def run_claims(python: str, venv: str, work: str, log) -> dict:
    """One pytest run per claim, so that a test module failing to import costs only its own claim."""
    env = clean_env(PYTHONPATH=REPO, TORCH_EXTENSIONS_DIR=os.path.join(work, "torch_extensions"),
                    PATH=os.path.join(venv, "bin") + os.pathsep + os.environ.get("PATH", ""),
                    **{ALLOW_UNTESTED_ENV: "1"})
    junit = os.path.join(work, "junit.xml")
    results = {}
    for claim, ids in CLAIMS.items():
        if os.path.exists(junit):
            os.remove(junit)
        log.flush()
        offset = os.path.getsize(log.name)
        started = time.monotonic()
        logged([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids], log, env,
               timeout=CLAIM_TIMEOUT)
        log.flush()
        with open(log.name, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        results[claim] = claim_result(ids, junit, output, time.monotonic() - started)
    return results


def run_cell(deepspeed: str, bnb: str, work: str, args) -> dict:
    venv = os.path.join(work, "venv")  # one path for every cell: torch's JIT build of the kernels records the torch
    shutil.rmtree(venv, ignore_errors=True)  # include path, so the same path lets later cells reuse the first build
    os.makedirs(LOG_DIR, exist_ok=True)
    log_path = os.path.join(LOG_DIR, f"deepspeed-{deepspeed}_bitsandbytes-{bnb}.log")
    record = {"deepspeed": deepspeed, "bitsandbytes": bnb, "date": datetime.date.today().isoformat(),
              "commit": git_commit()}
    started = time.monotonic()
    with open(log_path, "w") as log:
        problem = install(venv, deepspeed, bnb, args, log)
        record["install_seconds"] = round(time.monotonic() - started)
        python = os.path.join(venv, "bin", "python")
        record["installed"] = installed_versions(python) if not problem else {}
        if problem:
            log.flush()
            with open(log_path) as f:
                tail = f.read()
            record.update(install_error=problem + "\n" + excerpt(tail), claims={})
        else:
            record["claims"] = run_claims(python, venv, work, log)
    shutil.rmtree(venv, ignore_errors=True)
    record["seconds"] = round(time.monotonic() - started)
    record["log"] = os.path.basename(log_path)
    return record


def git_commit() -> str:
    """The commit the cell tested, "-dirty" when files other than this script's own results differ from it (the
    results are rewritten after every cell, so they differ from the second cell on)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    own = {os.path.relpath(path, REPO) for path in (RESULTS_JSON, RESULTS_MD)}
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True, cwd=REPO).stdout.splitlines()
    dirty = any(line[3:] not in own for line in changed)
    return commit.stdout.strip() + ("-dirty" if dirty else "")


def load_results() -> dict:
    if not os.path.exists(RESULTS_JSON):
        return {}
    with open(RESULTS_JSON) as f:
        return {(c["deepspeed"], c["bitsandbytes"]): c for c in json.load(f)["cells"]}


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def minutes(seconds) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def verdict(cell: dict, claim: str) -> str:
    if cell.get("install_error"):
        return "install failed"
    record = cell["claims"][claim]
    if record["outcome"] == "pass":
        return f"pass ({record['tests']} tests, {record['seconds']} s)"
    if record["outcome"] == "fail":
        return f"**FAIL** ({record['failed']} of {record['tests']} tests)"
    return "**not run**"


def render(results: dict) -> str:
    cells = [results[k] for k in sorted(results, key=lambda k: (release(k[0]), release(k[1])))]
    claims = list(CLAIMS)
    total = sum(cell["seconds"] for cell in cells)
    lines = [
        "# Compatibility matrix",
        "",
        "The core correctness tests of this repository against DeepSpeed and bitsandbytes releases, one fresh venv",
        f"per cell (CPU: {TORCH}, gloo ranks). Written by `tools/compat_matrix.sh` (rerun one cell with",
        "`tools/compat_matrix.sh --only deepspeed==X.Y.Z`); each verdict gives the number of tests behind it and their",
        "time. Time: the whole cell, venv and install included (the first cell of a run also JIT-compiles the",
        "kernels).",
        "",
        "| DeepSpeed | bitsandbytes | " + " | ".join(claims) + " | time | commit |",
        "|---|---|" + "---|" * len(claims) + "---:|---|",
    ]
    for cell in cells:
        lines.append(f"| {cell['deepspeed']} | {cell['bitsandbytes']} | "
                     + " | ".join(verdict(cell, c) for c in claims)
                     + f" | {minutes(cell['seconds'])} | {cell.get('commit', '')} |")
    lines += ["", f"Total: {minutes(total)} over {len(cells)} cells.", "", "Tests behind each claim:", ""]
    lines += [f"- {claim}: " + ", ".join(f"`{i}`" for i in ids) for claim, ids in CLAIMS.items()]
    failures = []
    for cell in cells:
        name = f"DeepSpeed {cell['deepspeed']}, bitsandbytes {cell['bitsandbytes']}"
        if cell.get("install_error"):
            failures += [f"### {name}: install", "", "```", cell["install_error"], "```", ""]
        for claim, record in cell.get("claims", {}).items():
            if record["outcome"] != "pass":
                where = f" (first: `{record['first_failed']}`)" if record.get("first_failed") else ""
                failures += [f"### {name}: {claim}{where}", "", "```", record["excerpt"], "```", ""]
    if failures:
        lines += ["", "## Failures", ""] + failures
    return "\n".join(lines).rstrip() + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="REQS",
                        help="run only the cells matching all of these pkg==version terms (repeatable: any of them)")
    parser.add_argument("--resume", action="store_true", help="skip cells already in tools/compat_matrix.json")
    parser.add_argument("--list", action="store_true", help="print the selected cells and exit")
    parser.add_argument("--render", action="store_true", help="only rewrite tools/compat_matrix.md from the json")
    parser.add_argument("--python", default=sys.executable, help="interpreter the venvs are made from "
                        "(default: this one; the torch wheel must match its version)")
    parser.add_argument("--torch-index", default="", help="a pip index holding the CPU build of torch, for machines "
                        "without a local copy, e.g. https://download.pytorch.org/whl/cpu")
    args = parser.parse_args()

    results = load_results()
    if args.render:
        write_atomically(RESULTS_MD, render(results))
        return
    cells = select(default_cells(args.python), args.only)
    if args.resume:
        cells = [c for c in cells if c not in results]
    if args.list:
        print("\n".join(f"deepspeed=={d} bitsandbytes=={b}" for d, b in cells))
        return
    print(f"compat_matrix: {len(cells)} cells; logs in {LOG_DIR}; {platform.python_version()} ({args.python})",
          flush=True)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("compat_matrix: terminated"))  # still delete the temp dir
    with tempfile.TemporaryDirectory(prefix="deepspeed_bnb_compat_") as work:  # the prefix excerpt() hides
        for n, (deepspeed, bnb) in enumerate(cells, 1):
            print(f"[{n}/{len(cells)}] deepspeed=={deepspeed} bitsandbytes=={bnb} ...", end=" ", flush=True)
            cell = run_cell(deepspeed, bnb, work, args)
            results[(deepspeed, bnb)] = cell
            write_atomically(RESULTS_JSON, json.dumps({"cells": list(results.values())}, indent=1) + "\n")
            write_atomically(RESULTS_MD, render(results))
            print(cell.get("install_error", "").split("\n")[0]
                  or ", ".join(f"{k}: {verdict(cell, k)}" for k in CLAIMS), f"[{minutes(cell['seconds'])}]",
                  flush=True)
    print(f"compat_matrix: done in {minutes(time.monotonic() - started)}; table in {os.path.relpath(RESULTS_MD)}")
    print(render(results).split("\n\nTests behind")[0].split("\n\n")[-1])


if __name__ == "__main__":
    main()
