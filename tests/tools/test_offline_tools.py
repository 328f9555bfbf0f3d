"""The offline tools (`deepspeed-bnb inspect/reshape/export/convert/migrate/kernels`) need no runtime: in a fresh
process each verb does its work without importing deepspeed_bnb's runtime (the DeepSpeed overrides) or its version
guard, and leaves every DeepSpeed class it loaded exactly as DeepSpeed defines it, even under a DeepSpeed release the
guard would refuse (here a faked 0.15.0); `kernels` runs with DeepSpeed not importable at all.
Control: the same probe after `import deepspeed_bnb` sees the runtime modules and the replaced methods.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import without_launch_vars
from support.toy import build_engine, train_steps

pytestmark = pytest.mark.slow  # every test runs a tool in a fresh process

# Runs `deepspeed_bnb_tools.main(argv)` (or, with "--runtime", `import deepspeed_bnb` only) and prints what it left.
PROBE = r"""
import importlib.metadata, json, sys
argv = json.loads(sys.argv[1])
real = importlib.metadata.version
importlib.metadata.version = lambda p: "0.15.0" if p == "deepspeed" else real(p)  # a release the guard refuses
if argv == ["--no-deepspeed"]:
    sys.modules["deepspeed"] = None  # any import of DeepSpeed fails
    argv = ["kernels"]
if argv == ["--runtime"]:
    import os
    os.environ["DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS"] = "1"
    import deepspeed_bnb
    code = 0
else:
    import deepspeed_bnb_tools
    try:
        code = deepspeed_bnb_tools.main(argv) or 0
    except SystemExit as exc:
        code = exc.code
mine = sorted(m for m in sys.modules if m.split(".")[0] == "deepspeed_bnb" and sys.modules[m] is not None)
changed, checked = [], 0
if sys.modules.get("deepspeed") is not None:
    from deepspeed_bnb.overrides import OVERRIDES, REPLACE  # the register itself imports nothing
    for entry in OVERRIDES:  # every replaced symbol whose module this process loaded: still DeepSpeed's own?
        module, _, attr = entry.owner.rpartition(".")
        if entry.how != REPLACE:
            continue
        if sys.modules.get(entry.owner) is not None:
            owner = sys.modules[entry.owner]
        elif sys.modules.get(module) is not None:
            owner = getattr(sys.modules[module], attr, None)
        else:
            continue
        value = getattr(owner, entry.name, None)
        checked += 1
        if getattr(value, "__module__", "").startswith("deepspeed_bnb"):
            changed.append(entry.key)
print("PROBE " + json.dumps({"code": code, "mine": mine, "changed": changed, "checked": checked,
                             "deepspeed": sys.modules.get("deepspeed") is not None}))
"""
RUNTIME = ("deepspeed_bnb.runtime", "deepspeed_bnb._versions", "deepspeed_bnb.integrations", "deepspeed_bnb.utils")


def probe(*argv, cwd=None) -> dict:
    env = without_launch_vars()
    env.pop("DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS", None)
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(argv))], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, f"{argv}: {done.returncode}\n{(done.stdout + done.stderr)[-4000:]}"
    result = json.loads(line[len("PROBE "):])
    result["output"] = done.stdout + done.stderr
    return result


def runtime_modules(result) -> list:
    # deepspeed_bnb.overrides is the register: data the probe itself imports to check the classes (not in RUNTIME)
    return [m for m in result["mine"] if m.startswith(RUNTIME)]


@pytest.fixture(scope="module")
def checkpoint(one_rank, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("offline"))
    engine = build_engine()
    train_steps(engine, range(2))
    engine.save_checkpoint(folder, tag="t")
    return os.path.join(folder, "t")


VERBS = {
    "inspect": lambda ckpt, out: ["inspect", ckpt, "--verify"],
    "reshape": lambda ckpt, out: ["reshape", ckpt, out, "--dp", "3", "--quiet"],
    "export": lambda ckpt, out: ["export", ckpt, out, "--quiet"],
    "convert": lambda ckpt, out: ["convert", ckpt, out, "--to", "32bit", "--quiet"],
    "migrate": lambda ckpt, out: ["migrate", ckpt, out, "--quiet"],
    "kernels": lambda ckpt, out: ["kernels"],
}


@pytest.mark.parametrize("verb", VERBS)
def test_verb_runs_without_the_runtime(checkpoint, tmp_path, verb):
    out = str(tmp_path / "out")
    result = probe(*VERBS[verb](checkpoint, out))
    assert result["code"] == 0, result["output"][-3000:]
    assert runtime_modules(result) == [], "the runtime (DeepSpeed overrides, version guard) was imported"
    assert result["changed"] == [], "a DeepSpeed symbol was replaced"
    if verb != "kernels":  # the checkpoint verbs load DeepSpeed (its classes are in the files): the check saw them
        assert result["deepspeed"] and result["checked"] >= 10, result["checked"]
    if verb not in ("inspect", "kernels"):
        assert os.listdir(out), f"{verb} wrote nothing"


def test_kernels_needs_no_deepspeed():
    result = probe("--no-deepspeed")
    assert result["code"] == 0 and not result["deepspeed"], result["output"][-3000:]


def test_control_the_runtime_import_is_seen():
    result = probe("--runtime")
    assert "deepspeed_bnb.runtime.engine" in runtime_modules(result)
    assert "DeepSpeedEngine.save_checkpoint" in result["changed"]
