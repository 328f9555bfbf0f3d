"""A JIT build of the kernels killed midway, then a load of them in a fresh process; writes FOLDER/killed_build.json.

For tests/kernels/test_jit_build_lock.py, which runs it as a background job (tests/support/background.py) and checks
what it recorded, in FOLDER (the one argument):
- a child loads the kernels with a fresh TORCH_EXTENSIONS_DIR (FOLDER/extensions) and is killed, with its ninja and
  compilers, once torch's build lock is there (`started`: whether it got that far, else why not);
- `stale`: the locks the kill left behind; `control`: whether torch's FileBaton, in a process without the suite's guard
  on JIT locks (tests/support/jit_guard.py), could take such a lock ("False": it would wait forever);
- `load`: a second process without that guard (what a user's process has: the loader) loads the kernels and runs the
  first-use check: its return code and output; `locks_after`: the locks left then.

    python tests/support/killed_jit_build.py FOLDER
"""

import glob
import json
import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)  # `import support` (support/__init__.py)

from support import process_tree  # noqa: E402

LOAD = ("import sys; from deepspeed_bnb.ops import loader, self_check; ok = loader.load(); "
        "print(loader.source(), loader.error()); "
        "sys.exit(0 if ok and self_check.disagreement('adam', 'cpu') is None else 1)")
STARTS_WITHIN = 600  # seconds for the killed child to get as far as torch's lock (imports, then the build starts)
RESULT = "killed_build.json"


def torch_locks(folder: str) -> list:
    return sorted(glob.glob(os.path.join(folder, "*", "lock")))


def kill_midway(env: dict, folder: str) -> str:
    """Start the build and kill it once torch's lock is there: "" when it was, else why it could not be."""
    child = subprocess.Popen([sys.executable, "-c", LOAD], env=env, cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        began = time.monotonic()
        while not torch_locks(folder):  # the build is under way once torch's lock is there
            if child.poll() is not None:
                return f"the build ended (exit {child.returncode}) before it could be killed midway"
            if time.monotonic() - began > STARTS_WITHIN:  # a hang guard: a busy machine is slow, not failed
                return f"the build did not start within {STARTS_WITHIN} s"
            time.sleep(0.2)
        return ""
    finally:
        process_tree.kill_session(child)  # the child and its ninja and compilers


def main(out: str) -> None:
    folder = os.path.join(out, "extensions")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=folder)
    record = {"started": kill_midway(env, folder) or True, "stale": torch_locks(folder)}
    bare = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # without the suite's guard
    if record["stale"]:
        control = subprocess.run([sys.executable, "-c", "import sys; from torch.utils.file_baton import FileBaton; "
                                  "print(FileBaton(sys.argv[1]).try_acquire())", record["stale"][0]], env=bare,
                                 capture_output=True, text=True, timeout=600)
        record["control"] = control.stdout.strip() or control.stderr[-3000:]
        done = subprocess.run([sys.executable, "-W", "always", "-c", LOAD], env=bare, cwd=ROOT, capture_output=True,
                              text=True, timeout=1200, check=False)
        record["load"] = {"returncode": done.returncode, "stdout": done.stdout[-20000:], "stderr": done.stderr[-20000:]}
        record["locks_after"] = torch_locks(folder)
    with open(os.path.join(out, RESULT), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
