"""ZeRO-Infinity's NVMe offload with bnb 8-bit state, on 2 CPU ranks (tests/support/nvme_scenarios.py), then loaded at
DP 1.

NVMe offload of the parameters (`offload_param.device: nvme`), of the optimizer (`offload_optimizer.device: nvme`: fp32
master partitions, gradients and bnb's 8-bit state on NVMe), and of both, trains exactly as CPU offload: the same losses
and final fp32 weights, bit for bit. Every checkpoint, of any kind, loads into an engine of any kind (built with another
seed) and continues exactly as the run that never stopped; at DP 1, a ZeRO-2 engine without offload and a ZeRO-3 engine
with the optimizer on NVMe continue within the bf16 bar. bf16 and compensated (bf16+8) master weights with the optimizer
on NVMe train and resume as with CPU offload, bit for bit. Controls: the NVMe runs held swap files on every rank, the
CPU run none; with the optimizer on NVMe, every swapped sub-group's fp32 partition and bnb state were out of memory
between steps (and one small sub-group stayed in memory, as DeepSpeed keeps those below 1 MiB); loading without the
optimizer state diverges.
Faults (`--faults`): an nvme_path that cannot be created fails initialize on every rank, naming it; a step whose swap
files were removed and whose disk is full (a small tmpfs, mounted here) raises the same NVMeSwapError on every rank,
naming the files, instead of aborting one rank in DeepSpeed's reader or training on what a short file held; the
engine then refuses to save (on every rank, no tag left), and the checkpoint saved before the fault resumes exactly
as the run that never stopped. The mount needs root: skipped, saying so, without it.
Skipped, naming what to install, where DeepSpeed's async_io op cannot be built (no libaio); `make test` installs
libaio-dev where it runs as root.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, torchrun, without_launch_vars
from support import background
from support.nvme_scenarios import KINDS, LOADERS_ELSEWHERE, SAVE_AT
from support import async_io
from support.async_io import aio_missing, require_aio

BF16_TOL = 5e-3  # as test_elastic.py: a change of DP size under bf16

pytestmark = [pytest.mark.multi_rank, pytest.mark.slow]


# the benchmark's quick run, a fresh process beside the earlier tests (tests/support/background.py); the timeout only
# ends a hang
NVME_BENCHMARK = background.Job("nvme_benchmark", lambda folder: [
    sys.executable, os.path.join(ROOT, "benchmarks", "nvme_offload.py"), "--quick", "--configs", "bnb8", "torch_adamw",
    "--out", os.path.join(folder, "out"), "--nvme", folder], without_launch_vars, timeout=1800)
BACKGROUND_JOBS = (NVME_BENCHMARK,)


@pytest.fixture(scope="module")
def nvme_benchmark():
    """The benchmark's results (its job is queued early where a collected test uses this fixture)."""
    require_aio()
    return background.json_result(NVME_BENCHMARK, "out", "nvme_offload.json")["results"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    require_aio()
    out = str(tmp_path_factory.mktemp("nvme"))
    torchrun("support/nvme_scenarios.py", 2, "--out", out)
    torchrun("support/nvme_scenarios.py", 1, "--out", out, "--load-only")
    with open(os.path.join(out, "nvme_results.json")) as f:
        found = json.load(f)
    with open(os.path.join(out, "nvme_loads_world1.json")) as f:
        found["dp1"] = json.load(f)
    return found


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cpu"])
def test_nvme_offload_trains_as_cpu_offload(results, kind):
    runs = results["runs"]
    assert runs["cpu"]["swap_files"] == [0, 0]
    assert all(n > 0 for n in runs[kind]["swap_files"]), runs[kind]["swap_files"]  # control: NVMe was used
    assert runs[kind]["losses"] == runs["cpu"]["losses"]
    assert runs[kind]["weights_equal_first"]


@pytest.mark.parametrize("kind", ["opt_nvme", "both_nvme"])
def test_optimizer_state_leaves_memory_between_steps(results, kind):
    for swapped, sub_groups, released in results["runs"][kind]["released"]:  # per rank
        assert 0 < swapped < sub_groups and released, (swapped, sub_groups, released)


@pytest.mark.parametrize("saved", KINDS)
@pytest.mark.parametrize("loader", KINDS)
def test_checkpoints_resume_exactly_across_offload_kinds(results, saved, loader):
    reference = results["runs"][saved]["losses"][SAVE_AT:]
    loaded = results["loads"][f"{saved}->{loader}"]
    assert loaded["losses"] == reference
    assert loaded["weights_equal"]
    assert max(abs(a - b) for a, b in zip(results["state_dropped"][saved], reference)) > 1e-3  # control


@pytest.mark.parametrize("saved", KINDS)
@pytest.mark.parametrize("loader", LOADERS_ELSEWHERE)
def test_checkpoints_load_at_dp1(results, saved, loader):
    reference = results["runs"][saved]["losses"][SAVE_AT:]
    assert max(abs(a - b) for a, b in zip(results["dp1"][f"{saved}->{loader}"], reference)) <= BF16_TOL


@pytest.fixture(scope="module", params=["bf16", "bf16+8"])
def bf16_masters(request, tmp_path_factory):
    """The CPU-offload run and the optimizer-on-NVMe run with bf16 or compensated (bf16+8) master weights, each saved
    at SAVE_AT and loaded by an engine of either kind."""
    require_aio()
    out = str(tmp_path_factory.mktemp(f"nvme_{request.param}"))
    torchrun("support/nvme_scenarios.py", 2, "--out", out, "--kinds", "cpu,opt_nvme", "--master-weights", request.param)
    torchrun("support/nvme_scenarios.py", 1, "--out", out, "--kinds", "cpu,opt_nvme", "--master-weights", request.param,
             "--load-only")
    with open(os.path.join(out, "nvme_results.json")) as f:
        found = json.load(f)
    with open(os.path.join(out, "nvme_loads_world1.json")) as f:
        found["dp1"] = json.load(f)
    return request.param, found


def test_bf16_master_weights_on_nvme_train_and_resume_as_on_cpu(bf16_masters):
    """bf16 master weights go to NVMe in DeepSpeed's swap files (its bf16 buffer pool), compensated ones with their
    error terms in files of deepspeed_bnb's swapper beside the state: the same losses and weights as CPU offload, bit
    for bit, out of memory between steps, and every checkpoint resumes exactly in either kind. Controls: NVMe was used
    (swap files), the error terms are in use where compensated, and a load without the optimizer state diverges. At DP
    1, each checkpoint continues within the bf16 bar under ZeRO-2 and with the optimizer on NVMe in the same mode.
    (Before this, both master modes were refused with NVMe; DeepSpeed 0.19.8's own bf16 master weights on NVMe assert at
    the first step's swap-in, the partition emptied as fp32 before it.)"""
    master, results = bf16_masters
    runs = results["runs"]
    assert runs["cpu"]["swap_files"] == [0, 0] and all(n > 0 for n in runs["opt_nvme"]["swap_files"])
    assert runs["opt_nvme"]["losses"] == runs["cpu"]["losses"] and runs["opt_nvme"]["weights_equal_first"]
    assert all(swapped > 0 and out for swapped, _, out in runs["opt_nvme"]["released"])  # error terms included
    compensated = master == "bf16+8"
    assert runs["cpu"]["error_terms_in_use"] == runs["opt_nvme"]["error_terms_in_use"] == [compensated] * 2
    reference = runs["cpu"]["losses"][SAVE_AT:]
    for pair, loaded in results["loads"].items():
        assert loaded["losses"] == reference and loaded["weights_equal"], pair
    for saved, losses in results["state_dropped"].items():
        assert max(abs(a - b) for a, b in zip(losses, reference)) > 1e-3, saved  # control
    assert sorted(results["dp1"]) == sorted(f"{saved}->{loader}" for saved in ("cpu", "opt_nvme")
                                            for loader in LOADERS_ELSEWHERE)
    for pair, losses in results["dp1"].items():  # at DP 1: ZeRO-2 (fp32 master weights), and NVMe in the same mode
        assert max(abs(a - b) for a, b in zip(losses, reference)) <= BF16_TOL, pair


def test_without_libaio_the_skip_names_the_package(monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    monkeypatch.setattr(async_io, "FIRST_CPU_SWAPPING", "0.0")  # any release reaches the libaio check
    monkeypatch.setattr(async_io, "LIBAIO_HEADER", os.path.join(os.path.dirname(__file__), "no-libaio.h"))
    assert "apt-get install libaio-dev" in aio_missing()
    monkeypatch.setattr(async_io, "LIBAIO_HEADER", __file__)  # a header that is there: a failed build
    assert "finds no usable libaio although" in aio_missing() and "apt-get" not in aio_missing()
    monkeypatch.undo()
    real = aio_missing()  # control: the real check answers too (None, libaio, or this DeepSpeed's CPU limit)
    assert real is None or "libaio" in real or "cannot run on CPU ranks" in real


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    require_aio()
    out = str(tmp_path_factory.mktemp("nvme_faults"))
    small = os.path.join(out, "small")
    os.makedirs(small)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", small], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"a full disk is simulated with a 48 MiB tmpfs, which this user cannot mount "
                    f"({mounted.stderr.strip() or mounted.returncode}): run as root")
    try:
        torchrun("support/nvme_scenarios.py", 2, "--out", out, "--faults", small)
    finally:
        subprocess.run(["umount", small], check=False)
    with open(os.path.join(out, "nvme_faults.json")) as f:
        return json.load(f)


def test_an_nvme_path_that_cannot_be_made_fails_initialize_on_every_rank(faults):
    first, second = faults["unwritable"]
    assert first == second and "Not a directory" in first and "a_file/nvme" in first, faults["unwritable"]


def test_a_full_disk_fails_the_step_on_every_rank_naming_the_files(faults):
    first, second = faults["full_disk"]
    assert first == second, faults["full_disk"]  # the same error on both ranks: agreed, not one rank alone
    assert first.startswith("NVMeSwapError: deepspeed_bnb: swapping optimizer state to NVMe failed during the "
                            "optimizer step: rank 0: "), first
    assert "bnb_state/rank0/sub0.state1.swp" in first and "rank 1: " in first
    assert "stored 0 of" in first and "holds 0 bytes" in first  # the full disk's write and the removed file's read
    assert "Free space under offload_optimizer.nvme_path" in first


def test_after_a_swap_failure_nothing_is_saved_and_the_last_checkpoint_resumes(faults):
    first, second = faults["save_after"]
    assert first == second and "refusing to save it" in first, faults["save_after"]
    assert "after" not in faults["tags"] and "good" in faults["tags"]
    assert faults["resumed"] == faults["reference"]  # the checkpoint before the fault: as if nothing happened


def test_the_nvme_benchmark_counts_the_bytes_the_state_sizes_give(nvme_benchmark):
    """benchmarks/nvme_offload.py in quick mode (bnb8 and torch AdamW): per rank and step both write and read the fp32
    master weights and gradients (8 bytes a parameter) and their state, 8 bytes (two fp32 moments) against 2 + 8/256
    (two 8-bit codes and their absmax per 256-element block), within 2% (partition padding). Control: the two counts
    differ, so a counter that saw nothing, or only DeepSpeed's swapper, would fail."""
    found = nvme_benchmark
    per_rank = found["bnb8"]["params"] / found["bnb8"]["world"]
    expected = {"torch_adamw": 8 + 8, "bnb8": 8 + 2 + 8 / 256}
    for config, per_param in expected.items():
        for rank in found[config]["ranks"]:
            for key in ("written_per_step", "read_per_step"):
                assert rank[key] == pytest.approx(per_param * per_rank, rel=0.02), (config, key, rank[key])
