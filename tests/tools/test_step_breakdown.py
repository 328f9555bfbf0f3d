"""Smoke test of benchmarks/step_breakdown.py: one rank, a few steps, the fused 8-bit path and torch's fused AdamW.

Checks what the table must show whatever the machine's speed: both configurations' rows, the parts each one runs
and only those (the fused kernel and its route in deepspeed_bnb's row; neither in stock DeepSpeed's with torch's
optimizer, whose `optimizer` part is torch's), nested parts no longer than the part they sit in, and the ratio column
against the last configuration; with `--bf16`, the inf/NaN check in both rows (and in neither with fp32); the top-level
parts and `other` adding up to the step (the host-bound model: the run that reads `other`). Control:
the torch row's kernel cell is "-", so a wrapper that timed nothing or everything would show.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, without_launch_vars

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import step_breakdown  # noqa: E402

pytestmark = pytest.mark.slow


def _rows(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(header, cells)) for cells in
            ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:])}


def _run(*args) -> dict:
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "step_breakdown.py"), *args],
                          env=without_launch_vars(), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return _rows(done.stdout)


def test_step_breakdown_times_the_parts_each_path_runs():
    rows = _run("--steps", "14")
    ours, torch_row = rows["bnb AdamW8bit, fused kernel"], rows["torch AdamW(fused=True) (fp32)"]
    assert torch_row["vs last"] == "1.00x" and ours["vs last"].endswith("x")
    for part in ("engine.step()", "norm", "optimizer", "route", "fused", "kernel", "bnb", "all-gather"):
        assert ours[part] != "-" and float(ours[part]) > 0, part
    assert float(ours["kernel"]) <= float(ours["fused"]) <= float(ours["optimizer"]) <= float(ours["engine.step()"])
    assert float(torch_row["optimizer"]) > 0 and float(torch_row["norm"]) > 0
    assert torch_row["kernel"] == torch_row["route"] == torch_row["bnb"] == "-"
    assert "overflow" not in ours  # an fp32 step checks no gradient for inf/NaN


def test_step_breakdown_of_a_bf16_model_times_the_overflow_check():
    """bf16 (DeepSpeed checks the gradients for inf/NaN before the step): both rows time that check. On the
    host-bound model (many tiny tensors), where `other`, the step's time outside the wrapped parts, is what is read."""
    rows = _run("--steps", "12", "--bf16", "--host-bound")
    for row in rows.values():
        assert float(row["overflow"]) > 0 and float(row["overflow"]) <= float(row["engine.step()"])
        top_level = [float(row[part]) for part in step_breakdown.TOP_LEVEL + ("other",) if row[part] != "-"]
        assert float(row["other"]) >= 0  # negative where two top-level parts overlap (time counted twice)
        # two timed steps: a median of two is their mean, so the shown columns add up to the step unless the table
        # leaves out a part that `other` subtracts
        assert sum(top_level) == pytest.approx(float(row["engine.step()"]), abs=1e-3 * len(top_level))
