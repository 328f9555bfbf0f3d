"""What the client tests (test_clients.py, test_trl.py) share: the tiny runs' arguments, a run's log (the JSON an
example writes with --log_json) and how far two runs' losses are apart."""

import json
import os

TINY = "--max_steps 12 --global_batch 8 --width 64 --depth 2 --context 64 --text_mb 1"
CONTROL_MIN = 1e-2  # a resume without the optimizer state moves the losses by 0.1-0.3: its control must exceed this


def read(out, name):
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


def max_diff(run, reference):
    """Largest |loss difference| over the steps `run` made; `losses` are lists from step `start` or {step: loss}."""
    def by_step(log):
        losses = log["losses"]
        return {str(log.get("start", 0) + 1 + i): v for i, v in enumerate(losses)} if isinstance(losses, list) \
            else losses
    mine, theirs = by_step(run), by_step(reference)
    assert mine and set(mine) <= set(theirs), (sorted(mine), sorted(theirs))
    return max(abs(value - theirs[step]) for step, value in mine.items())
