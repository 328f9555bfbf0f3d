"""The GPU proof (tests/gpu/proof.py) rehearsed on the CPU, so that it cannot rot between GPU runs, and the checkpoint
a GPU wrote loaded at DP 2 on CPU ranks.

- The rehearsal (`--dry-run`) runs every part of the proof on the CPU: each check inside it compares with an
  independent reference (plain bnb, the kernels' pure-torch reference, the CPU's continuation); here it must hold in
  full and write the report and the checkpoint the GPU run would bring back.
- Controls, so that the proof cannot pass vacuously: its engine check catches a reference stepped with another
  learning rate, its large-parameter check catches bnb's update pieces placed one block off, its continuation bars
  refuse a continuation off by twice the weight bar.
- A device's checkpoint (gpu_checkpoint.tar: the tag and the device's own continuation) loads at DP 2 on CPU ranks and
  continues within the bars: the rehearsal's always; each one committed under benchmarks/results/gpu/ by a run on a
  GPU machine, or a skip saying none has been committed yet.
- Installing on the machine: which carried wheels are installed (proof_bundle.plan).
"""

import glob
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time
import types
import zipfile

import pytest

import deepspeed_bnb  # noqa: F401  (the in-process controls build engines with the bnb_* keys)
from conftest import TESTS, launch_env, torchrun
from support import background, jit_guard

sys.path.append(os.path.join(TESTS, "gpu"))

import cross_device  # noqa: E402
import part_checkpoints  # noqa: E402
import proof  # noqa: E402
import proof_bundle  # noqa: E402
import proof_common  # noqa: E402
import proof_report  # noqa: E402

pytestmark = pytest.mark.multi_rank  # the rehearsal launches ranks
ROOT = os.path.dirname(TESTS)
PROOF = os.path.join(TESTS, "gpu", "proof.py")
GPU_RESULTS = os.path.join(ROOT, "benchmarks", "results", "gpu")
ALL_PARTS = ("env", "a", "k", "b+c", "d", "e", "f", "f3", "s", "s3", "so", "m", "p", "o", "g", "h")
# part h builds DeepSpeed's async_io op, which needs libaio: without it here (not root, so make test could not
# install it) the rehearsal leaves that part out, as tests/distributed/test_nvme.py skips
PARTS = ALL_PARTS if os.path.isfile("/usr/include/libaio.h") else ALL_PARTS[:-1]


def _rehearsal_command(folder: str) -> list:
    return [sys.executable, PROOF, "--dry-run", "--out", os.path.join(folder, "out"), "--work",
            os.path.join(folder, "work"), "--parts", ",".join(PARTS)]


# The dry run runs beside the tests collected before this module's (tests/support/background.py). It has no overall
# deadline (a busy machine slows it, never fails it); the up-front builds and each part are bounded by their
# budgets, and so is the whole: this timeout only ends a hang.
def _rehearsal_env() -> dict:
    # OpenMP threads that sleep at a barrier instead of spinning: a part that uses every core (o) otherwise slows down
    # many times over while other jobs share the cores
    return dict(launch_env(), OMP_WAIT_POLICY="PASSIVE")


REHEARSAL = background.Job("rehearsal", _rehearsal_command, _rehearsal_env, proof.BUILD_BUDGET + 300 + sum(
    p.budget * proof.DRY_RUN_BUDGET_FACTOR for p in proof.PARTS if p.name in PARTS))
BACKGROUND_JOBS = (REHEARSAL,)


@pytest.fixture(scope="module")
def rehearsal():
    """The dry run's exit code and output, report and output folder."""
    done = background.result(REHEARSAL)
    if done.returncode is None:
        pytest.fail(f"the rehearsal ran past its hang guard ({REHEARSAL.timeout:.0f} s):\n{done.stdout[-3000:]}"
                    f"{done.stderr[-3000:]}")
    out = pathlib.Path(done.folder) / "out"
    path = out / "report.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    return done, report, out


def test_rehearsal_leaves_no_build_lock_behind(rehearsal):
    """The rehearsal shares this run's JIT folder: no build of it may be left holding torch's build lock (a later
    build of the same extension would wait on it forever). Control: the folder was used."""
    from torch.utils.cpp_extension import get_default_build_root
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    assert os.path.isdir(folder) and os.listdir(folder), folder
    # a lock some live process holds open is a build under way (the suite's next background job), not one left
    locks = [lock for lock in glob.glob(os.path.join(folder, "**", "lock"), recursive=True)
             if not jit_guard.holders(lock)]
    assert not locks, locks


def test_rehearsal_every_part_holds(rehearsal):
    done, report, out = rehearsal
    log = (out / "proof.log").read_text(errors="replace")[-4000:] if (out / "proof.log").is_file() else ""
    assert report is not None, f"no report:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    failing = {p["part"]: [c["name"] for c in p["checks"] if not c["ok"]] or p.get("error") or p.get("skipped")
               for p in report["parts"] if not p["ok"]}
    assert not failing, f"{failing}\n{done.stdout[-2000:]}\n{log}"
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert tuple(p["part"] for p in report["parts"]) == PARTS
    assert all(len(p["checks"]) >= 1 for p in report["parts"])
    markdown = (out / "report.md").read_text()
    for part in report["parts"]:
        assert f"## {part['part']}: {part['title']} (holds)" in markdown
    assert sorted(os.listdir(out)) == ["gpu_checkpoint.tar", "proof.log", "report.json", "report.md"]


def test_report_shows_a_failing_check():
    report = {"device": "x", "mode": "GPU", "command": "c", "started": "now", "deadline": 1.0, "seconds": 1.0,
              "install": None, "parts": [
                  {"part": "a", "title": "t", "ok": False, "seconds": 1, "tables": [], "notes": ["n"], "error": "boom",
                   "checks": [{"name": "kernel == reference", "ok": False, "measured": "3 codes", "bar": "0"}]},
                  {"part": "b", "title": "u", "ok": False, "seconds": None, "tables": [], "notes": [], "error": None,
                   "checks": [], "skipped": "5 s of the deadline left"}]}
    markdown = proof_report.render(report)
    assert "| a | t | FAILS (1 of 1 checks, and an error) | 1 |" in markdown
    assert "| **FAIL** | kernel == reference | 3 codes | 0 |" in markdown and "boom" in markdown
    assert "not run: 5 s of the deadline left" in markdown


# a part that finishes one stage, checkpoints, and is then killed in the next (as proof.py kills a part at its deadline)
_STOPPED_PART = """
import sys
sys.path.insert(0, {gpu!r})
import proof_common
result = proof_common.Result("o", "stopped", "cpu", {path!r})
result.table("o: the first size", ["elements"], [["64M"]])
if {checkpoint}:
    result.checkpoint()
open({ready!r}, "w").close()
sys.stdin.read()  # the next stage, never finished: killed here
"""


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_part_killed_after_a_checkpoint_reports_what_it_finished(tmp_path, checkpoint):
    """A part killed in its second stage shows its first stage's table in the report, as a part that does not hold and
    says it stopped early. Control: without the checkpoint the same kill leaves no result at all."""
    path, ready, log = tmp_path / "o.json", tmp_path / "ready", tmp_path / "proof.log"
    log.write_text("the part's output\n")
    script = _STOPPED_PART.format(gpu=os.path.join(TESTS, "gpu"), path=str(path), ready=str(ready),
                                  checkpoint=checkpoint)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    try:
        while not ready.exists():  # the child reached its second stage (no time bar: a busy machine only delays it)
            assert child.poll() is None, f"the stand-in part exited early ({child.returncode})"
            time.sleep(0.2)
    finally:
        child.kill()
        child.wait()
    found = proof.part_result(proof.Part("o", "part_offload.py", 1), str(path), None, 1.0, str(log))
    assert found["ok"] is False
    if checkpoint:
        assert [t["title"] for t in found["tables"]] == ["o: the first size"]
        assert found["error"] == proof_common.Result.UNFINISHED
        assert "o: the first size" in proof_report.render({**_REPORT, "parts": [found]})
    else:
        assert found["tables"] == [] and "wrote no result (timed out)" in found["error"]


_REPORT = {"device": "x", "mode": "GPU", "command": "c", "started": "now", "deadline": 1.0, "seconds": 1.0,
           "install": None}


# a part on one CPU rank, which notes the name of DeepSpeed's shared-memory buffer and whether it exists while it runs
_SHM_PART = """
import os
import sys
sys.path.insert(0, {gpu!r})
import proof_common


def body(args, result):
    proof_common.one_rank("cpu")
    port = os.environ["MASTER_PORT"]
    buffer = os.path.join("/dev/shm", f"deepspeed_allreduce_buffer_{{os.getuid()}}_127.0.0.1_{{port}}_0")
    result.note(buffer)
    result.check("the buffer exists while the part runs", os.path.exists(buffer), buffer, "exists")


proof_common.run_part("z", "a part on one CPU rank", body)
"""


def test_a_part_on_one_cpu_rank_leaves_no_shared_memory_behind(tmp_path):
    """DeepSpeed's CPU comm op creates a 66 MB /dev/shm buffer per rank and never removes it; a part ends with
    os._exit (which skips atexit handlers) and removes its own first (the rehearsal runs about fifteen of them per
    test run). Control: the buffer existed while the part ran."""
    script = _SHM_PART.format(gpu=os.path.join(TESTS, "gpu"))
    done = subprocess.run([sys.executable, "-c", script, "--device", "cpu", "--result", str(tmp_path / "z.json"),
                           "--work", str(tmp_path)], env=launch_env(), capture_output=True, text=True, timeout=900)
    result = json.loads((tmp_path / "z.json").read_text())
    assert result["error"] is None and result["notes"], (result, done.stderr[-3000:])
    if not result["checks"][0]["ok"]:
        pytest.skip("this DeepSpeed's CPU accelerator made no shared-memory buffer (no shm comm op)")
    assert not os.path.exists(result["notes"][0]), result["notes"][0]


@pytest.mark.parametrize("precision, master", [("fp32", "fp32"), ("bf16", "bf16+8")])
def test_control_the_engine_check_catches_another_update(one_rank, monkeypatch, precision, master):
    import part_engines

    class Off(part_engines.PlainBnb):
        def __init__(self, *args):
            super().__init__(*args)
            for group in self.optimizer.param_groups:
                group["lr"] *= 1.001
    monkeypatch.setattr(part_engines, "PlainBnb", Off)
    result = proof_common.Result("b", "control", "cpu")
    part_engines.equals_plain(types.SimpleNamespace(device="cpu"), result, 2, precision, master)
    routed, equal = result.data["checks"]
    assert routed["ok"] and not equal["ok"] and "first difference after step 1" in equal["measured"]


def test_control_the_large_parameter_check_catches_misplaced_pieces(one_rank, monkeypatch):
    import part_large

    from deepspeed_bnb.ops import bnb_update
    from deepspeed_bnb.optim import bnb_adapter
    from support.planted_bugs import split_one_block_early
    monkeypatch.setattr(bnb_update, "MAX_UPDATE_NUMEL", bnb_update.MAX_UPDATE_NUMEL)  # restored after the test
    monkeypatch.setattr(bnb_adapter, "split_segment", split_one_block_early)
    result = proof_common.Result("e", "control", "cpu")
    part_large.run_path(types.SimpleNamespace(device="cpu"), result, fused=False)
    windows = next(c for c in result.data["checks"] if "every window" in c["name"])
    assert not windows["ok"] and "weights" in windows["measured"]


def test_continuation_bars_refuse_a_continuation_off_by_twice_the_weight_bar():
    import torch
    weights = {"w": torch.zeros(4)}
    expected = {"losses": [1.0, 0.5], "weights": weights}
    same = {"losses": [1.0, 0.5], "weights": {"w": torch.zeros(4)}}
    off = {"losses": [1.0, 0.5], "weights": {"w": torch.tensor([0.0, 2 * cross_device.WEIGHT_TOLERANCE, 0.0, 0.0])}}
    assert cross_device.compare(expected, same)["exact"]
    assert not cross_device.compare(expected, off)["within"]
    late = {**same, "losses": [1.0, 0.5 + 2 * cross_device.LOSS_TOLERANCE]}
    assert not cross_device.compare(expected, late)["within"]
    # across devices the loss bar is the wider one, and it still refuses twice itself
    assert cross_device.compare({**expected, "device": "cpu"}, {**late, "device": "cuda"})["within"]
    later = {**same, "device": "cuda", "losses": [1.0, 0.5 + 2 * cross_device.CROSS_DEVICE_LOSS_TOLERANCE]}
    assert not cross_device.compare({**expected, "device": "cpu"}, later)["within"]


def device_checkpoints():
    found = sorted(glob.glob(os.path.join(GPU_RESULTS, "*", part_checkpoints.TAR)))
    return [pytest.param(path, id=os.path.basename(os.path.dirname(path))) for path in found] or \
        [pytest.param(None, id="gpu")]


def resume_at_dp2(tar: str, folder) -> dict:
    with tarfile.open(tar) as archive:
        archive.extractall(folder, filter="data")
    save = os.path.join(folder, part_checkpoints.GPU_SAVE)
    result = os.path.join(folder, "resumed.json")
    torchrun(os.path.join("gpu", "cross_device.py"), 2, "resume", "--dir", save, "--tag", cross_device.GPU_TAG,
             "--expect", os.path.join(save, part_checkpoints.GPU_CONTINUATION), "--result", result)
    with open(result) as f:
        return json.load(f)


def test_rehearsal_checkpoint_loads_at_dp2_on_cpu(rehearsal, tmp_path):
    _, _, out = rehearsal
    found = resume_at_dp2(str(out / part_checkpoints.TAR), tmp_path)
    assert found["within"], found
    assert found["to"] == "cpu at DP 2" and found["from"] == "cpu at DP 1"


@pytest.mark.parametrize("tar", device_checkpoints())
def test_gpu_checkpoint_loads_at_dp2_on_cpu(tar, tmp_path):
    if tar is None:
        pytest.skip(f"no GPU has run the proof yet: {GPU_RESULTS} holds no */{part_checkpoints.TAR} (run "
                    f"tests/gpu/proof.py on a GPU machine and commit its OUT folder there: DEVELOPERS.md)")
    found = resume_at_dp2(tar, tmp_path)
    assert found["within"], found
    assert found["to"] == "cpu at DP 2" and found["from"].startswith("cuda")


def fake_wheel(folder, name: str, version: str, requires=()) -> str:
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}"
                         .format(name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)))
    return path


def test_install_plan_installs_what_the_machine_lacks_or_has_too_old(tmp_path):
    deepspeed_needs = ["hjson", "pydantic>=2.0.0", "docutils<0.18; extra == 'dev'"]
    wheels = [fake_wheel(tmp_path, "deepspeed", "0.19.8", deepspeed_needs),
              fake_wheel(tmp_path, "hjson", "3.1.0"),
              fake_wheel(tmp_path, "pydantic", "2.14.4", ["typing-extensions>=4.14.1"]),
              fake_wheel(tmp_path, "typing_extensions", "4.16.0"),
              fake_wheel(tmp_path, "docutils", "0.17")]
    machine = {"deepspeed": "0.18.0", "pydantic": "2.14.4", "typing-extensions": "4.10.0", "docutils": "0.21"}
    chosen = {proof_bundle.wheel_name(p)[0]: why for p, why in
              proof_bundle.plan(wheels, lambda name: machine.get(name)).items()}
    assert sorted(chosen) == ["deepspeed", "hjson", "typing-extensions"]
    assert "the release under test" in chosen["deepspeed"] and "not installed there" in chosen["hjson"]
    assert "4.10.0 is installed, but pydantic needs typing-extensions>=4.14.1" in chosen["typing-extensions"]
    machine["typing-extensions"] = "4.15.0"  # control: new enough, the machine's own serves
    assert "typing-extensions" not in {proof_bundle.wheel_name(p)[0] for p in
                                       proof_bundle.plan(wheels, lambda name: machine.get(name))}


def test_proof_docstring_runs_the_parts_it_lists():
    import proof
    for part in proof.PARTS:
        assert f"{part.name:<4} {part.script}" in proof.__doc__, part
        assert os.path.isfile(os.path.join(TESTS, "gpu", part.script))
    assert tuple(p.name for p in proof.PARTS) == ALL_PARTS
