"""Compatibility matrix: this repository's core correctness tests against DeepSpeed x bitsandbytes x torch x Python.

A cell is one DeepSpeed release (or DeepSpeed's development head, "master"), one bitsandbytes release, one torch
release and one Python. The default cells: every DeepSpeed release with the current bitsandbytes on torch 2.13.0
(the local CPU build) and Python 3.11; the previous bitsandbytes releases; and the torch releases the frameworks
people train with pin (TORCH_CELLS: PyPI's CUDA builds of torch, run on the CPU, as a GPU user has them).

Environments are kept and reused between cells and runs (under ~/.cache/deepspeed_bnb/compat_matrix/envs):
- one base venv per Python, torch and bitsandbytes release, holding that torch (pinned, never reinstalled; a
  constraints file keeps every later install from swapping it), that bitsandbytes and what DeepSpeed and the tests
  need, but no DeepSpeed;
- one venv per cell, holding only DeepSpeed, installed without dependencies from a wheel built once from its sdist
  (`DS_BUILD_OPS=0`, no CUDA; wheels cached beside the envs); a `.pth` file puts the base venv's packages behind it.
A cell then costs its tests: the repository's tests run once per cell (one pytest, so the multi-rank launches that
several claims share run once) with PYTHONPATH at the repository root (this checkout's deepspeed_bnb and tests),
DEEPSPEED_BNB_SCENARIO_SIZES=1,2 (the claims need DP 1 and 2 only) and the cell venv's own TORCH_EXTENSIONS_DIR
(deepspeed_bnb's kernels and DeepSpeed's CPU comm op are JIT-built once per venv and kept: one directory for every
release would rebuild DeepSpeed's op, same name and other sources, at every switch, several times a cell).

Results are merged into tools/compat_matrix.json cell by cell (a rerun of one cell replaces that cell only) and
rendered as the table in tools/compat_matrix.md, with a failure excerpt per failing claim. Run by hand; not part of
`make test`. Full logs go to ~/.cache/deepspeed_bnb/compat_matrix/logs.

  tools/compat_matrix.sh                                           # every default cell
  tools/compat_matrix.sh --only deepspeed==0.18.4                  # the cells with that release
  tools/compat_matrix.sh --only "deepspeed==0.19.8 bitsandbytes==0.49.1"  # one cell (also one outside the defaults)
  tools/compat_matrix.sh --only torch==2.6.0                       # the cells on that torch
  tools/compat_matrix.sh --only deepspeed==master --deepspeed-master ~/src/DeepSpeed  # DeepSpeed's head, from a
                                                                   # checkout (default: a clone from GitHub)
  tools/compat_matrix.sh --resume                                  # skip cells already in the results
  tools/compat_matrix.sh --resume --since 8ff8373                  # ... tested at that commit or a later one (a
                                                                   # whole rerun, interrupted, goes on where it was)
  tools/compat_matrix.sh --list                                    # the selected cells, without running them
"""

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_JSON = os.path.join(REPO, "tools", "compat_matrix.json")
RESULTS_MD = os.path.join(REPO, "tools", "compat_matrix.md")
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "deepspeed_bnb", "compat_matrix")
LOG_DIR, ENVS, WHEELS = (os.path.join(CACHE, part) for part in ("logs", "envs", "wheels"))
ALLOW_UNTESTED_ENV = "DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"  # deepspeed_bnb/_versions.py (not importable here)

TORCH, PYTHON = "2.13.0", "3.11"  # the default cells': the CPU build pip finds on this machine's disk, for 3.11
# DeepSpeed's own requirements (the same from 0.16.4 to 0.19.8), setup.py's besides torch, deepspeed and
# bitsandbytes, and what the tests need; DeepSpeed itself goes into each cell's venv
BASE_PACKAGES = ("einops", "hjson", "msgpack", "ninja", "numpy", "packaging>=20.0", "psutil", "py-cpuinfo",
                 "pydantic>=2.0.0", "tqdm", "safetensors",
                 # setup.py's `test` extra: the suite refuses to start without it
                 "pytest", "accelerate>=1.0", "transformers>=4.45", "trl>=1.16", "datasets", "matplotlib", "build")
BUILD_PACKAGES = ("setuptools", "wheel")  # DeepSpeed's sdist is built without isolation, against the pinned torch

FIRST, LAST = (0, 16, 4), (0, 19, 8)  # the DeepSpeed releases of the default cells, every one in between
BNB_CURRENT, BNB_PREVIOUS = "0.50.2", ("0.49.1", "0.49.2")
REFERENCE = ("0.19.8", BNB_CURRENT, TORCH, PYTHON)  # the other side of the cross-release claim (its own: the oldest)
OLDEST = (".".join(map(str, FIRST)), BNB_CURRENT, TORCH, PYTHON)
# (torch, Python, DeepSpeed releases, bitsandbytes): the pins of the frameworks DeepSpeed and bitsandbytes are used
# through, and the newest torch releases; PyPI's torch wheels for Linux are CUDA builds (several GB with their
# nvidia-* libraries), which run on the CPU
TORCH_CELLS = (
    ("2.6.0", "3.11", ("0.16.4", "0.18.4"), BNB_CURRENT),  # LLaMA-Factory's image (its DeepSpeed cap 0.18.4)
    ("2.7.1", "3.11", ("0.17.6",), BNB_CURRENT),  # the minor releases between the pins, each with a DeepSpeed of
    ("2.8.0", "3.11", ("0.19.5",), BNB_CURRENT),  # its time; TRL's image is 2.8.0; OpenRLHF pins DeepSpeed 0.19.5
    ("2.9.1", "3.11", ("0.18.4",), BNB_CURRENT),
    ("2.10.0", "3.11", ("0.19.2",), BNB_CURRENT),
    ("2.11.0", "3.11", ("0.18.9",), "0.49.1"),  # Axolotl (torch 2.11-2.12.1, DeepSpeed 0.18.x, bnb 0.49.1)
    ("2.12.1", "3.11", ("0.18.9",), "0.49.1"),
    ("2.14.1", "3.11", ("0.19.8",), BNB_CURRENT),
    ("2.15.0", "3.11", ("0.19.8",), BNB_CURRENT),
    ("2.15.0", "3.12", ("0.19.8",), BNB_CURRENT),
)
MASTER = "master"  # DeepSpeed's development head, built from a checkout (--deepspeed-master); never accepted by the
MASTER_URL = "https://github.com/deepspeedai/DeepSpeed"  # import guard without the opt-in (its number is the next
# release's, with the commit as local label)

SIZES = "1,2"  # tests/support/scenario_runs.py: the DP sizes the claims need


def _elastic(kinds, pairs=((2, 1), (1, 2))):
    return [f"tests/distributed/test_elastic.py::test_load_at_any_dp[{k}-{n}-{m}]" for k in kinds for n, m in pairs]


# claim (table column) -> the test ids that establish it; each test carries its own negative control
NVME_IDS = ("tests/distributed/test_nvme.py::test_nvme_offload_trains_as_cpu_offload",
            "tests/distributed/test_nvme.py::test_checkpoints_resume_exactly_across_offload_kinds")
STAGE3_UNSCALE = "tests/unit/test_stage3_unscale.py"  # its compensated-master case needs DeepSpeed 0.18.3 on
CLAIMS = {
    "sharded == unsharded": ["tests/kernels/test_sharded_update.py"],
    "DP=1 == plain bnb": ["tests/kernels/test_matches_bnb.py::test_zero_dp1_matches_plain_bnb",
                          "tests/kernels/test_matches_bnb.py::test_control_stock_zero_differs_from_plain_bnb",
                          "tests/unit/test_stage3.py::test_stage3_dp1_equals_plain_bnb"],
    "elastic 2->1, 1->2 (ZeRO-1, 2, 3)": _elastic(("fp32_stage1", "bf16_stage2", "fp32_stage3")),
    "same-DP resume": [f"tests/distributed/test_distributed.py::test_same_dp_resume_is_bit_exact[{case}-2]"
                       for case in ("stage1_rigid", "stage1_elastic", "stage2_rigid", "stage2_elastic")],
    "ZeRO-3 DP invariance": [f"tests/distributed/test_distributed.py::test_fp32_tracks_single_rank[{config}-2]"
                             for config in ("fp32_stage3", "fp32_stage3_zero_init", "fp32_stage3_offload")]
                            + ["tests/distributed/test_distributed.py::test_stage3_matches_stage2[2]",
                               "tests/distributed/test_distributed.py::test_stock_deepspeed_does_not_track_single_rank"
                               "[3-DeepSpeedZeroOptimizer_Stage3-2]"],
    "one checkpoint format": ["tests/distributed/test_cross_release.py"],
    # the register's entries, and the owned copy of DeepSpeed's unscale/clip factor and the batched inf/NaN check
    # against DeepSpeed's own methods
    "override register": ["tests/unit/test_overrides.py",
                          "tests/kernels/test_matches_bnb.py::test_fused_unscale_factor_is_deepspeeds",
                          f"{STAGE3_UNSCALE}::test_the_factor_handed_to_the_step_is_deepspeeds",
                          f"{STAGE3_UNSCALE}::test_clipped_training_equals_deepspeeds_own_unscale[fp32]",
                          "tests/unit/test_overflow_check.py",
                          # the model's copy written by the kernel in place of DeepSpeed's conversion in its step
                          "tests/unit/test_model_copy_engine.py"],
    "NVMe offload (ZeRO-3)": list(NVME_IDS),
    "control: stock + torch AdamW": ["tests/unit/test_stock_control.py"],
    # the offline writers on a 2-rank ZeRO-3 checkpoint with frozen parameters, and convert of a stock ZeRO-3 one
    "offline tools (ZeRO-3)": ["tests/distributed/test_offline_frozen.py", "tests/distributed/test_convert_zero3.py"],
}
# tests that cannot run for a cell, and why: they run bitsandbytes' own update on the CPU, which 0.49 does not have
# (a claim left with none of its tests is n/a; one left with some says how many were n/a)
NOT_APPLICABLE = {
    "bitsandbytes 0.49": (("tests/kernels/test_sharded_update.py", "tests/kernels/test_matches_bnb.py",
                           "tests/unit/test_stage3.py::test_stage3_dp1_equals_plain_bnb",
                           "tests/distributed/test_distributed.py::test_stock_deepspeed_does_not_track_single_rank"),
                          "bitsandbytes 0.49 has no optimizer update on a CPU: plain bnb (the oracle) and stock ZeRO "
                          "(the controls) cannot step there"),
}
# claims checked from the reference environment, pointing a test at the cell's Python (claim -> variable, ids)
FROM_REFERENCE = {"0.49 == 0.50.2 (fused kernel)": ("DEEPSPEED_BNB_BNB049_PYTHON",
                                                    ["tests/distributed/test_bnb_049.py"])}
CLAIM_TIMEOUT = 5400  # seconds of pytest per cell: a hung gloo group must not stall the whole matrix


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
    """(deepspeed, bitsandbytes, torch, python) of every default cell: every DeepSpeed release from FIRST to LAST with
    the current bitsandbytes; the previous bitsandbytes releases with the newest DeepSpeed and with the newest 0.18
    (Axolotl's pins); TORCH_CELLS; DeepSpeed's head."""
    deepspeed = [v for v in index_releases(python, "deepspeed") if FIRST <= release(v) <= LAST]
    newest_018 = [v for v in deepspeed if release(v)[:2] == (0, 18)][-1:]
    pairs = [(v, BNB_CURRENT) for v in deepspeed] + [(d, b) for b in BNB_PREVIOUS for d in [deepspeed[-1]] + newest_018]
    return ([(d, b, TORCH, PYTHON) for d, b in pairs]
            + [(d, bnb, torch, py) for torch, py, releases, bnb in TORCH_CELLS for d in releases]
            + [(MASTER, BNB_CURRENT, TORCH, PYTHON)])


AXES = ("deepspeed", "bitsandbytes", "torch", "python")  # a cell's key, in this order


def parse_only(text: str) -> dict:
    """"deepspeed==0.19.7 bitsandbytes==0.49.2" -> {"deepspeed": "0.19.7", "bitsandbytes": "0.49.2"}."""
    wanted = {}
    for term in text.replace(",", " ").split():
        axis, sep, version = term.partition("==")
        if not sep or axis not in AXES or not (release(version) or (axis == "deepspeed" and version == MASTER)):
            sys.exit(f"compat_matrix: --only {text!r}: {term!r} is not one of deepspeed==X.Y.Z (or deepspeed=="
                     f"{MASTER}), bitsandbytes==X.Y.Z, torch==X.Y.Z, python==X.Y")
        wanted[axis] = version
    return wanted


def select(cells, only):
    """The cells matching any --only (all its terms); a --only naming DeepSpeed and bitsandbytes (and optionally torch
    and Python, else the defaults) is a cell of its own."""
    if not only:
        return cells
    chosen = []
    for wanted in map(parse_only, only):
        matching = [c for c in cells if all(wanted.get(axis, value) == value for axis, value in zip(AXES, c))]
        if not matching and {"deepspeed", "bitsandbytes"} <= set(wanted):
            matching = [(wanted["deepspeed"], wanted["bitsandbytes"], wanted.get("torch", TORCH),
                         wanted.get("python", PYTHON))]
        if not matching:
            sys.exit(f"compat_matrix: --only {' '.join(f'{k}=={v}' for k, v in wanted.items())} matches no cell; "
                     f"name DeepSpeed and bitsandbytes (and torch, Python) to run a cell outside the default list")
        chosen += [c for c in matching if c not in chosen]
    return chosen


def interpreter(version: str) -> str:
    """The `python3.X` to make a cell's venvs with: on PATH, or one pyenv installed."""
    found = shutil.which(f"python{version}")
    candidates = [found] if found else []
    candidates += sorted(glob.glob(os.path.join(os.path.expanduser("~"), ".pyenv", "versions", f"{version}.*", "bin",
                                                f"python{version}")))
    for candidate in candidates:
        if subprocess.run([candidate, "-c", "import venv"], capture_output=True).returncode == 0:
            return candidate
    raise RuntimeError(f"no Python {version} found (python{version} on PATH, or pyenv install {version})")


def clean_env(**extra) -> dict:
    """This environment without another venv's or checkout's paths, plus `extra`."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", ALLOW_UNTESTED_ENV, "DEEPSPEED_BNB_ZERO_PADDING")
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


def python_of(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def extensions_dir(python: str) -> str:
    """The JIT cache of the venv `python` belongs to (as tests/conftest.py gives the Pythons it launches)."""
    return os.path.join(os.path.dirname(os.path.dirname(python)), "torch_extensions")


def site_packages(python: str) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def ready(venv: str) -> bool:
    return os.path.exists(os.path.join(venv, ".ready"))


def base_name(bnb: str, torch: str, python: str) -> str:
    return f"base-py{python}-torch{torch}-bnb{bnb}"


def prune(remaining) -> None:
    """--prune: remove the venvs on another torch or Python than the defaults that no remaining cell (nor its
    partners) needs: each CUDA build of torch with its libraries takes 5-7 GB. The default torch's stay."""
    keep = {name for cell in remaining for c in (cell, *partners(cell)) for name in (cell_name(*c), base_name(*c[1:]))}
    for venv in glob.glob(os.path.join(ENVS, "*")):
        name = os.path.basename(venv)
        on_defaults = f"-torch{TORCH}-" in name and name.startswith(f"base-py{PYTHON}-") or "-torch" not in name
        if name not in keep and not on_defaults:
            shutil.rmtree(venv, ignore_errors=True)


def base_venv(bnb: str, torch: str, python: str, args, log) -> str:
    """The shared venv of a Python, torch and bitsandbytes release (and DeepSpeed's and the tests' needs); made once."""
    venv = os.path.join(ENVS, base_name(bnb, torch, python))
    constraints = os.path.join(venv, "constraints.txt")
    # PIP_CONSTRAINT, not -c: it replaces a constraint file from pip's configuration (one capping torch, say) instead of
    # adding to it, so the cell gets the torch it names or fails saying so
    env = clean_env(PIP_CONSTRAINT=constraints)
    pip = [python_of(venv), "-m", "pip", "install", "--progress-bar", "off"]
    wanted = " ".join((f"bitsandbytes=={bnb}",) + BASE_PACKAGES)
    if ready(venv):
        with open(os.path.join(venv, ".ready")) as f:
            if f.read() != wanted:  # made when BASE_PACKAGES held less: add the rest, torch stays
                if logged(pip + wanted.split(), log, env) != 0:
                    raise RuntimeError(f"pip install {wanted} failed")
        with open(os.path.join(venv, ".ready"), "w") as f:
            f.write(wanted)
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    made_from = args.python if args.python and python == PYTHON else interpreter(python)
    if logged([made_from, "-m", "venv", venv], log, clean_env()) != 0:
        raise RuntimeError("python -m venv failed")
    with open(constraints, "w") as f:
        f.write(f"torch=={torch}\n")  # nothing below may swap this torch for another
    torch_index = ["--index-url", args.torch_index] if args.torch_index and torch == TORCH else []
    if logged(pip + [f"torch=={torch}", *BUILD_PACKAGES] + torch_index, log, env) != 0:
        raise RuntimeError(f"pip install torch=={torch} failed (Python {python})")
    if logged(pip + wanted.split(), log, env) != 0:
        raise RuntimeError(f"pip install bitsandbytes=={bnb} and the tests' packages failed")
    with open(os.path.join(venv, ".ready"), "w") as f:
        f.write(wanted)
    return venv


def master_source(args, log) -> tuple:
    """(a source tree of DeepSpeed's head, its short commit): --deepspeed-master (a checkout, or a bare git directory,
    whose HEAD is exported), else a shallow clone of MASTER_URL into the cache."""
    git_dir = args.deepspeed_master or os.path.join(CACHE, "deepspeed-master.git")
    if not args.deepspeed_master:
        shutil.rmtree(git_dir, ignore_errors=True)
        if logged(["git", "clone", "--bare", "--depth", "1", MASTER_URL, git_dir], log, clean_env()) != 0:
            raise RuntimeError(f"git clone {MASTER_URL} failed: pass a checkout with --deepspeed-master")
    if os.path.isdir(os.path.join(git_dir, ".git")):
        git_dir = os.path.join(git_dir, ".git")
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "--short=9", "HEAD"], capture_output=True,
                            text=True)
    if commit.returncode != 0:
        raise RuntimeError(f"--deepspeed-master {git_dir}: not a git repository ({commit.stderr.strip()})")
    tree = os.path.join(CACHE, "deepspeed-master-src")
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(tree)
    # a partial copy (a mirror that leaves out its largest files: images, mostly) cannot `git archive` them: export
    # what is there, and name what is not
    listing = subprocess.run(["git", f"--git-dir={git_dir}", "ls-tree", "-r", "-z", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.split("\0")
    entries = [(line.split("\t", 1)[0].split()[2], line.split("\t", 1)[1]) for line in listing if "\t" in line]
    present = subprocess.run(["git", f"--git-dir={git_dir}", "cat-file", "--batch-check"], capture_output=True,
                             text=True, input="".join(f"{sha}\n" for sha, _ in entries)).stdout.splitlines()
    absent = [path for (sha, path), line in zip(entries, present) if line.endswith(" missing")]
    if absent:
        log.write(f"\ncompat_matrix: {len(absent)} files of {git_dir} are not in that copy, left out: {absent}\n")
    cmd = ["git", f"--git-dir={git_dir}", "archive", "-o", tree + ".tar", "HEAD", "--", "."]
    if logged(cmd + [f":(exclude,literal){path}" for path in absent], log, clean_env()) != 0 or \
            logged(["tar", "-xf", tree + ".tar", "-C", tree], log, clean_env()) != 0:
        raise RuntimeError(f"exporting {git_dir} failed")
    os.remove(tree + ".tar")
    return tree, git_dir, commit.stdout.strip()


def deepspeed_wheel(deepspeed: str, base: str, args, log) -> str:
    """DeepSpeed's wheel, built once from its sdist against the base venv's torch (no ops compiled ahead); for
    MASTER, built from its source at every run, its version the next release's with the commit as local label."""
    def build(source: str, folder: str, what: str, **env) -> str:
        cmd = [python_of(base), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--progress-bar", "off",
               "-w", folder, source]
        if logged(cmd, log, clean_env(DS_BUILD_OPS="0", **env)) != 0:
            raise RuntimeError(f"building {what} failed")
        return glob.glob(os.path.join(folder, f"deepspeed-{'*' if deepspeed == MASTER else deepspeed + '-*'}.whl"))[0]

    os.makedirs(WHEELS, exist_ok=True)
    if deepspeed == MASTER:
        tree, git_dir, _ = master_source(args, log)
        for old in glob.glob(os.path.join(WHEELS, "master", "*.whl")):
            os.remove(old)
        # DeepSpeed's setup.py reads the commit with `git rev-parse`: GIT_DIR lets it see the exported tree's
        return build(tree, os.path.join(WHEELS, "master"), "DeepSpeed's head", GIT_DIR=git_dir)
    found = glob.glob(os.path.join(WHEELS, f"deepspeed-{deepspeed}-*.whl"))
    return found[0] if found else build(f"deepspeed=={deepspeed}", WHEELS, f"the deepspeed=={deepspeed} wheel")


def cell_name(deepspeed: str, bnb: str, torch: str, python: str) -> str:
    """The cell's venv and log name; the default torch and Python leave it as it was before those axes."""
    extra = "" if (torch, python) == (TORCH, PYTHON) else f"-torch{torch}-py{python}"
    return f"deepspeed{deepspeed}-bnb{bnb}{extra}"


def cell_venv(cell, args, log) -> str:
    """The cell's venv: DeepSpeed alone, the base venv's packages behind it; made once, reused afterwards (DeepSpeed's
    head: remade at every run)."""
    deepspeed, bnb, torch, python = cell
    base = base_venv(bnb, torch, python, args, log)  # first: the cell's venv reads its packages from there
    venv = os.path.join(ENVS, cell_name(*cell))
    if ready(venv) and deepspeed != MASTER:
        return venv
    wheel = deepspeed_wheel(deepspeed, base, args, log)
    shutil.rmtree(venv, ignore_errors=True)
    made_from = os.path.realpath(python_of(base))  # the base venv's interpreter: the same Python
    if logged([made_from, "-m", "venv", "--without-pip", venv], log, clean_env()) != 0:
        raise RuntimeError("python -m venv failed")
    with open(os.path.join(site_packages(python_of(venv)), "zz_compat_matrix_base.pth"), "w") as f:
        f.write(site_packages(python_of(base)) + "\n")  # after the venv's own packages: its DeepSpeed wins
    cmd = [python_of(base), "-m", "pip", "install", "--no-deps", "--progress-bar", "off",
           "--target", site_packages(python_of(venv)), wheel]
    if logged(cmd, log, clean_env()) != 0:
        raise RuntimeError(f"installing {os.path.basename(wheel)} failed")
    open(os.path.join(venv, ".ready"), "w").close()
    return venv


def installed_versions(python: str) -> dict:
    code = ("import json, platform, importlib.metadata as m; "
            "print(json.dumps({**{p: m.version(p) for p in ('deepspeed', 'bitsandbytes', 'torch')}, "
            "'python': platform.python_version()}))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=clean_env())
    return json.loads(done.stdout) if done.returncode == 0 else {}


def node_id(case) -> str:
    return case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")


def excerpt(text: str, lines: int = 4) -> str:
    """The last few distinct error lines of a failure (exception lines and failed asserts), shortened, with the
    checkout and the environments named by role rather than by path (the table is committed)."""
    text = text.replace(ENVS + os.sep, "<envs>/").replace(REPO + os.sep, "")
    found = []
    for line in text.splitlines():
        line = line.strip()
        if re.match(r"^(E\s+)?([\w.]*(Error|Exception|Interrupt)\b|assert |Failed:|ERROR:)", line):
            line = re.sub(r"^E\s+", "", line)[:300]
            if line in found:
                found.remove(line)
            found.append(line)
    return "\n".join(found[-lines:]) or text.strip()[-600:]


def claim_result(ids, cases, output: str, seconds: float) -> dict:
    """Outcome of one claim: pass / fail / not run, test counts, seconds and a failure excerpt."""
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


def pytest_run(python: str, ids, work: str, log, **env_extra):
    """One pytest over `ids`: (its junit test cases, its output, seconds)."""
    junit = os.path.join(work, "junit.xml")
    if os.path.exists(junit):
        os.remove(junit)
    # the import guard accepts the releases that passed this matrix: a cell must run to be judged at all
    # the up-front builds (tests/support/prebuild.py): the CPU comm op every launch loads; the claims' tests load no
    # other DeepSpeed op, and building fused Adam, CPU Adam and async_io in every release's venv took minutes a cell
    env = clean_env(PYTHONPATH=REPO, PATH=os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""),
                    DEEPSPEED_BNB_SCENARIO_SIZES=SIZES, DEEPSPEED_BNB_PREBUILD_OPS="ShareMemCommBuilder",
                    **{ALLOW_UNTESTED_ENV: "1"}, **env_extra)
    log.flush()
    offset = os.path.getsize(log.name)
    started = time.monotonic()
    logged([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids], log, env,
           timeout=CLAIM_TIMEOUT)
    log.flush()
    with open(log.name, "rb") as f:
        f.seek(offset)
        output = f.read().decode(errors="replace")
    cases = list(ElementTree.parse(junit).getroot().iter("testcase")) if os.path.exists(junit) else []
    return cases, output, time.monotonic() - started


def seconds_of(cases, ids) -> float:
    return sum(float(c.get("time", 0)) for c in cases
               if any(node_id(c) == i or node_id(c).startswith((i + "::", i + "[")) for i in ids))


def not_applicable(bnb: str):
    """(test ids that cannot run with this bitsandbytes release, why) or ((), "")."""
    for prefix, (ids, why) in NOT_APPLICABLE.items():
        if f"bitsandbytes {bnb}".startswith(prefix):
            return ids, why
    return (), ""


def release_limits() -> dict:
    """tests/support/release_limits.py's values, read without importing the test suite (it needs torch)."""
    limits = {}
    with open(os.path.join(REPO, "tests", "support", "release_limits.py")) as f:
        exec(compile(f.read(), f.name, "exec"), limits)  # plain assignments of this repository's own file
    return limits


def deepspeed_cannot(deepspeed: str):
    """(test ids that cannot run with this DeepSpeed release on CPU ranks, why) or ((), ""); DeepSpeed's head can."""
    limits = release_limits()
    if deepspeed != MASTER and release(deepspeed) < release(limits["FIRST_CPU_SWAPPING"]):
        return NVME_IDS, f"DeepSpeed {deepspeed}'s {limits['NO_CPU_SWAPPING']}"
    return (), ""


def partners(cell) -> tuple:
    """(the cell whose Python is the other side of the cross-release claim, the cell whose Python checks the claims
    FROM_REFERENCE). The first has another DeepSpeed: REFERENCE, or the oldest release for cells of REFERENCE's own
    DeepSpeed (on another torch, that trip crosses torch releases too). The second is REFERENCE on the cell's torch
    and Python: those claims compare bitsandbytes releases bit for bit, which another torch's arithmetic would
    confound."""
    other = OLDEST if cell[0] == REFERENCE[0] else REFERENCE
    return other, (REFERENCE[0], REFERENCE[1], cell[2], cell[3])


def run_claims(cell, python: str, work: str, log) -> dict:
    """Every claim of the cell: one pytest in the cell's venv, and the claims checked from the reference venv."""
    deepspeed, bnb = cell[:2]
    other, reference = (python_of(os.path.join(ENVS, cell_name(*c))) for c in partners(cell))
    bnb_limit = not_applicable(bnb)
    excluded = bnb_limit[0]
    limits = [limit for limit in (bnb_limit, deepspeed_cannot(deepspeed)) if limit[0]]

    def why_not(test_id):
        return next((why for ids, why in limits if test_id.startswith(ids)), None)

    here = {claim: [i for i in ids if why_not(i) is None] for claim, ids in CLAIMS.items()}
    skipped = {claim: why_not(CLAIMS[claim][0]) for claim, ids in here.items() if not ids}
    here = {claim: ids for claim, ids in here.items() if ids}
    cases, output, _ = pytest_run(python, sorted({i for ids in here.values() for i in ids}), work, log,
                                  TORCH_EXTENSIONS_DIR=extensions_dir(python), DEEPSPEED_BNB_OTHER_PYTHON=other)
    results = {claim: claim_result(ids, cases, output, seconds_of(cases, ids)) for claim, ids in here.items()}
    for claim, ids in here.items():
        if len(ids) < len(CLAIMS[claim]):
            results[claim]["not_applicable"] = [i for i in CLAIMS[claim] if i not in ids]
    results.update({claim: {"outcome": "n/a", "why": why} for claim, why in skipped.items()})
    if excluded:  # the cell's own release cannot be its oracle: check it against the reference's
        for claim, (variable, ids) in FROM_REFERENCE.items():
            cases, output, seconds = pytest_run(reference, ids, work, log, **{variable: python},
                                                TORCH_EXTENSIONS_DIR=extensions_dir(reference))
            results[claim] = claim_result(ids, cases, output, seconds)
    return results


def warm_up(python: str, log) -> None:
    """Build DeepSpeed's CPU comm op and deepspeed_bnb's kernels into the venv's JIT cache in one process, before any
    test: the first launch in a fresh cache otherwise has two ranks build DeepSpeed's op at once, and one of them
    has been seen loading a .so the other had not written yet (DeepSpeed 0.18.2, "cannot open shared object file").
    A failure here is left to the tests to report."""
    code = ("from deepspeed.comm.torch import build_shm_op; build_shm_op(); "
            "from deepspeed_bnb.ops import loader; loader.load()")
    logged([python, "-c", code], log, clean_env(PYTHONPATH=REPO, TORCH_EXTENSIONS_DIR=extensions_dir(python),
                                                **{ALLOW_UNTESTED_ENV: "1"}), timeout=1800)


def run_cell(cell, work: str, args) -> dict:
    os.makedirs(LOG_DIR, exist_ok=True)
    log_path = os.path.join(LOG_DIR, cell_name(*cell) + ".log")
    record = {**dict(zip(AXES, cell)), "date": datetime.date.today().isoformat(), "commit": git_commit()}
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            python = python_of(cell_venv(cell, args, log))
            other, reference = partners(cell)
            cell_venv(other, args, log)
            if not_applicable(cell[1])[0]:  # the claims checked from the reference run there
                cell_venv(reference, args, log)
        except RuntimeError as exc:
            log.flush()
            with open(log_path) as f:
                tail = f.read()
            record.update(install_error=f"{exc}\n{excerpt(tail)}", claims={}, installed={})
        else:
            record["install_seconds"] = round(time.monotonic() - started)
            record["installed"] = installed_versions(python)
            if cell[0] == MASTER:
                record["deepspeed_commit"] = record["installed"].get("deepspeed", "").partition("+")[2]
            warm_up(python, log)
            record["claims"] = run_claims(cell, python, work, log)
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


def key(cell: dict) -> tuple:
    """A result's cell; results from before the torch and Python axes ran on the defaults."""
    return cell["deepspeed"], cell["bitsandbytes"], cell.get("torch", TORCH), cell.get("python", PYTHON)


def tested_since(cell: dict, since: str) -> bool:
    """Whether the cell's result counts as current for --resume: any result without --since; with it, a result recorded
    at that commit or a descendant (a dirty tree's result never counts: what it tested is not in history)."""
    if not since:
        return True
    commit = cell.get("commit", "")
    if not commit or commit.endswith("-dirty"):
        return False
    known = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{since}^{{commit}}"], capture_output=True,
                           cwd=REPO)
    if known.returncode != 0:
        sys.exit(f"compat_matrix: --since {since}: not a commit of this repository (use one from `git log`)")
    return subprocess.run(["git", "merge-base", "--is-ancestor", since, commit], capture_output=True,
                          cwd=REPO).returncode == 0


def load_results() -> tuple:
    """(cell key -> its result, the disk footprint last measured)."""
    if not os.path.exists(RESULTS_JSON):
        return {}, None
    with open(RESULTS_JSON) as f:
        saved = json.load(f)
    return {key(c): {**dict(zip(AXES, key(c))), **c} for c in saved["cells"]}, saved.get("disk")


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def disk_usage() -> dict:
    """What the kept environments and wheels take on disk (the matrix's footprint), measured now."""
    done = subprocess.run(["du", "-sb", ENVS, WHEELS], capture_output=True, text=True)
    return {"bytes": sum(int(line.split()[0]) for line in done.stdout.splitlines() if line.split()),
            "environments": len(glob.glob(os.path.join(ENVS, "*", ".ready"))),
            "date": datetime.date.today().isoformat()}


def disk_line(disk) -> list:
    if not disk:
        return []
    return [f"Disk: at most {disk['bytes'] / 2 ** 30:.1f} GiB at once, in {disk['environments']} environments and the "
            f"DeepSpeed wheels (~/.cache/deepspeed_bnb/compat_matrix, {disk['date']})."]


def minutes(seconds) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def verdict(cell: dict, claim: str) -> str:
    if cell.get("install_error"):
        return "install failed"
    record = cell["claims"].get(claim)
    if record is None:
        return ""
    if record["outcome"] == "pass":
        extra = f"; {len(record['not_applicable'])} n/a" if record.get("not_applicable") else ""
        return f"pass ({record['tests']}{extra})"
    if record["outcome"] == "n/a":
        return "n/a"
    if record["outcome"] == "fail":
        return f"**FAIL** ({record['failed']} of {record['tests']})"
    return "**not run**"


def passed(cell: dict) -> bool:
    """Every claim of the cell passed (or cannot apply to it)."""
    return not cell.get("install_error") and all(r["outcome"] in ("pass", "n/a") for r in cell["claims"].values())


def claims_of(cells) -> list:
    return list(CLAIMS) + [c for c in FROM_REFERENCE if any(c in cell.get("claims", {}) for cell in cells)]


def order(cell) -> tuple:
    """Table order: the default torch and Python first, by bitsandbytes then DeepSpeed; then the other torch
    releases; DeepSpeed's head last."""
    deepspeed, bnb, torch, python = cell
    return (deepspeed == MASTER, (torch, python) != (TORCH, PYTHON), release(torch), release(python),
            release(bnb) != release(BNB_CURRENT), release(bnb), release(deepspeed) or ())


def deepspeed_label(cell: dict) -> str:
    return f"{MASTER} ({cell['deepspeed_commit']})" if cell.get("deepspeed_commit") else cell["deepspeed"]


def render(results: dict, disk=None) -> str:
    cells = [results[k] for k in sorted(results, key=order)]
    claims = claims_of(cells)
    total = sum(cell["seconds"] for cell in cells)
    lines = [
        "# Compatibility matrix",
        "",
        "The core correctness tests of this repository against DeepSpeed, bitsandbytes and torch releases and "
        "Pythons (CPU,",
        "gloo ranks), written by `tools/compat_matrix.sh` (one cell: `tools/compat_matrix.sh --only deepspeed==X.Y.Z`;",
        f"one torch: `--only torch==X.Y.Z`). torch {TORCH} is the local CPU build; the other torch releases are PyPI's",
        "CUDA builds, run on the CPU. Each verdict gives the number of tests behind it; n/a: the claim cannot hold for",
        "that release (why below); blank: not run for that cell (a claim added after the cell's run at `commit`, or",
        "one for other releases). Time: the cell's tests (its environment is made once and reused).",
        "",
        "| DeepSpeed | bitsandbytes | torch | Python | " + " | ".join(claims) + " | time | commit |",
        "|---|---|---|---|" + "---|" * len(claims) + "---:|---|",
    ]
    for cell in cells:
        tested = cell["seconds"] - cell.get("install_seconds", 0)
        lines.append(f"| {deepspeed_label(cell)} | {cell['bitsandbytes']} | {cell['torch']} | {cell['python']} | "
                     + " | ".join(verdict(cell, c) for c in claims)
                     + f" | {minutes(tested)} | {cell.get('commit', '')} |")
    lines += ["", f"Total: {minutes(total)} over {len(cells)} cells (environments made in that run included).",
              *disk_line(disk), "",
              "Tests behind each claim:", ""]
    lines += [f"- {claim}: " + ", ".join(f"`{i}`" for i in ids) for claim, ids in CLAIMS.items()]
    lines += [f"- {claim} (run in DeepSpeed {REFERENCE[0]} / bitsandbytes {REFERENCE[1]}'s environment with {var} "
              f"set to the cell's Python): " + ", ".join(f"`{i}`" for i in ids)
              for claim, (var, ids) in FROM_REFERENCE.items()]
    lines += [f"- n/a for {prefix}: " + ", ".join(f"`{i}`" for i in ids) + f" ({why})"
              for prefix, (ids, why) in NOT_APPLICABLE.items()]
    limits = release_limits()
    lines += [f"- n/a for DeepSpeed before {limits['FIRST_CPU_SWAPPING']}: " + ", ".join(f"`{i}`" for i in NVME_IDS)
              + f" (their {limits['NO_CPU_SWAPPING']})"]
    failures = []
    for cell in cells:
        name = f"DeepSpeed {deepspeed_label(cell)}, bitsandbytes {cell['bitsandbytes']}, torch {cell['torch']}, " \
               f"Python {cell['python']}"
        if cell.get("install_error"):
            failures += [f"### {name}: install", "", "```", cell["install_error"], "```", ""]
        for claim, record in cell.get("claims", {}).items():
            if record["outcome"] not in ("pass", "n/a"):
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
    parser.add_argument("--since", default="", metavar="COMMIT", help="with --resume: count as done only the cells "
                        "tested at COMMIT or at a commit that contains it")
    parser.add_argument("--list", action="store_true", help="print the selected cells and exit")
    parser.add_argument("--render", action="store_true", help="only rewrite tools/compat_matrix.md from the json")
    parser.add_argument("--python", default=None, help=f"interpreter the Python {PYTHON} venvs are made from (default: "
                        f"python{PYTHON} on PATH or pyenv's; other Pythons are found the same way)")
    parser.add_argument("--torch-index", default="", help=f"a pip index holding the CPU build of torch {TORCH}, for "
                        "machines without a local copy, e.g. https://download.pytorch.org/whl/cpu")
    parser.add_argument("--prune", action="store_true", help="remove each other torch's venvs once no remaining cell "
                        "needs them (5-7 GB each; the Disk line then counts what was there after each cell)")
    parser.add_argument("--deepspeed-master", default="", metavar="DIR", help="a DeepSpeed checkout (or bare git "
                        f"directory) whose HEAD the {MASTER} cell builds; default: a shallow clone of {MASTER_URL}")
    args = parser.parse_args()

    results, disk = load_results()
    if args.render:
        write_atomically(RESULTS_MD, render(results, disk))
        return
    cells = select(default_cells(sys.executable), args.only)
    if args.since and not args.resume:
        parser.error("--since COMMIT only narrows --resume: add --resume")
    if args.resume:
        cells = [c for c in cells if c not in results or not tested_since(results[c], args.since)]
    if args.list:
        print("\n".join(" ".join(f"{axis}=={value}" for axis, value in zip(AXES, cell)) for cell in cells))
        return
    print(f"compat_matrix: {len(cells)} cells; logs in {LOG_DIR}; {platform.python_version()} ({args.python})",
          flush=True)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("compat_matrix: terminated"))
    work = os.path.join(CACHE, "work")
    os.makedirs(work, exist_ok=True)
    # a JIT build killed midway (an interrupted matrix) leaves its lock behind, and the next build of that op waits for
    # it forever (torch's FileBaton): the matrix runs one cell at a time, so any lock there now is stale
    for lock in glob.glob(os.path.join(ENVS, "*", "torch_extensions", "**", "lock"), recursive=True):
        os.remove(lock)
    for n, cell_key in enumerate(cells, 1):
        print(f"[{n}/{len(cells)}]", " ".join(f"{axis}=={value}" for axis, value in zip(AXES, cell_key)), "...",
              end=" ", flush=True)
        cell = run_cell(cell_key, work, args)
        results[cell_key] = cell
        disk = max(disk_usage(), disk or {}, key=lambda d: d.get("bytes", 0))  # the most the run has held
        if args.prune:
            prune(cells[n:])
        write_atomically(RESULTS_JSON, json.dumps({"cells": list(results.values()), "disk": disk}, indent=1) + "\n")
        write_atomically(RESULTS_MD, render(results, disk))
        print(cell.get("install_error", "").split("\n")[0]
              or ", ".join(f"{k}: {verdict(cell, k)}" for k in cell["claims"]), f"[{minutes(cell['seconds'])}]",
              flush=True)
    print(f"compat_matrix: done in {minutes(time.monotonic() - started)}; table in {os.path.relpath(RESULTS_MD)}")
    print(render(results, disk).split("\n\nTests behind")[0].split("\n\n")[-1])


if __name__ == "__main__":
    main()
