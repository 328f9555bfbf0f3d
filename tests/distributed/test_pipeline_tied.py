"""Modules tied across pipeline stages (TiedLayerSpec) through the 8-bit universal checkpoint, at 2 stages and at 1.

The common GPT pipeline ties its embedding to the last stage's head; a fine-tuning run may freeze a tied module whole.
Each stage holds its own copy of a tied module, and a layer file names only its index, so the export must take each
copy under its module's name (`tied_modules.<key>.*`: the save records it per layer file) and keep one. Source: 2
stages, DP 1, ZeRO-1, 3 steps (tests/support/pipeline_tied.py). Loaded by engines of another seed: at 2 stages (in the
launch) every rank's state_dict is the saving rank's and the next 5 losses are the run's that never stopped, exactly;
at 1 stage (here) the state_dict is the two stages' together and the losses track the run within 1e-5. Control: the
loaders' own weights, the frozen tied module's among them, differed before the load.
"""

import json
import os

import pytest
import torch

from conftest import torchrun

pytestmark = pytest.mark.multi_rank


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_tied")
    torchrun("support/pipeline_tied.py", 2, str(out))
    held = [torch.load(os.path.join(out, f"rank{rank}.pt"), weights_only=False) for rank in range(2)]
    with open(os.path.join(out, "losses.json")) as f:
        return out, held, json.load(f)


def test_two_stages_load_every_tied_copy_and_continue_exactly(launched):
    from support.pipeline_tied import FROZEN
    _, held, losses = launched
    for rank, one in enumerate(held):
        assert any(name.startswith(FROZEN) for name in one["saved"]), rank  # each stage holds the tied modules
        assert any(name.startswith("tied_modules.embed.") for name in one["saved"]), rank
        assert sorted(one["loaded"]) == sorted(one["saved"])
        for name, tensor in one["saved"].items():
            assert torch.equal(one["loaded"][name], tensor), (rank, name)
        assert all(not torch.equal(one["before"][name], one["saved"][name]) for name in one["saved"]
                   if name.startswith(FROZEN)), rank  # control: the loader's own frozen copy
    assert losses["resumed"] == losses["continued"]


def test_one_stage_loads_the_joined_model_and_tracks_the_run(one_rank, launched):
    from support.pipeline_tied import CONTINUED_STEPS, build, state, train
    out, held, losses = launched
    saved = {**held[1]["saved"], **held[0]["saved"]}
    assert all(torch.equal(held[1]["saved"][name], tensor) for name, tensor in held[0]["saved"].items()
               if name in held[1]["saved"])  # the stages' tied copies are one value
    loader = build(seed=1, stages=1, universal=True)
    assert any(not torch.equal(tensor, saved[name]) for name, tensor in state(loader).items())  # control
    loader.load_checkpoint(os.path.join(out, "universal"))
    loaded = state(loader)
    assert sorted(loaded) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    resumed = train(loader, CONTINUED_STEPS)
    assert max(abs(a - b) for a, b in zip(resumed, losses["continued"])) < 1e-5, (resumed, losses["continued"])
