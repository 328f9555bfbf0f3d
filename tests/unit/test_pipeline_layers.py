"""A pipeline engine's module through the offline tools (checkpoint/format/weights.py: pipeline_layers).

DeepSpeed saves a PipelineModule's weights and buffers only in its per-layer files (`layer_<i>-model_states.pt`, each
layer's own state_dict; the model states' `module` is None) and, under ZeRO-1, records no frozen parameters at all.
Checked against the engine that saved (one rank, one stage: the offline tools read one model-parallel rank): `export`
gives its whole state_dict, trained weights, a wholly frozen layer, buffers, and tied modules under their own names
(`tied_modules.<key>.*`, which their layer files do not say: the save records each layer file's module name); the
8-bit universal export, loaded by an engine built from another seed, gives that engine the saving engine's
state_dict. Controls: the loader's own frozen weights and buffers differ from the saved ones before the load; without
the recorded names a wholly frozen tied module (nothing of it in the optimizer record to recognise it by) is read
under its layer index.
"""

import os
from unittest import mock

import pytest
import torch

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.weights import _known, pipeline_layers, recorded_layers
from deepspeed_bnb.cli import main
from support.parallel_scenarios import Block, Embed, pipeline_loss
from support.pipeline_tied import FROZEN as FROZEN_TIED  # a tied module (used twice) frozen whole, with no buffer
from support.pipeline_tied import Mix, engine_of, state, tied_head, train

FROZEN_LAYER = "3."  # every parameter of this layer is frozen


def build(seed, universal=False):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    torch.manual_seed(seed)
    model = PipelineModule([TiedLayerSpec("embed", Embed), TiedLayerSpec("mix", Mix), LayerSpec(Block, 64),
                            LayerSpec(Block, 32), TiedLayerSpec("mix", Mix),
                            TiedLayerSpec("embed", Embed, forward_fn=tied_head)],
                           num_stages=1, loss_fn=pipeline_loss, partition_method="uniform")
    return engine_of(model, (FROZEN_LAYER, FROZEN_TIED), 1, lr=1e-3, universal=universal)


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pipeline")
    engine = build(seed=0)
    train(engine, range(2))
    engine.save_checkpoint(str(folder / "ckpt"), tag="t")
    return folder, state(engine)


def test_the_save_keeps_the_module_in_layer_files_only(saved):
    folder, expected = saved
    states = torch.load(folder / "ckpt" / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["module"] is None and not states.get("frozen_param_shapes")  # what the reader must work around
    assert any(name.startswith("tied_modules.embed.") for name in expected)  # the model ties a module
    assert any(name.startswith(FROZEN_LAYER) and name.endswith("shift") for name in expected)  # and has buffers
    files = sorted(os.listdir(folder / "ckpt" / "t"))
    assert [name for name in files if name.startswith("layer_")] == \
        [f"layer_0{i}-model_states.pt" for i in range(5)]  # the last layer (a tied forward_fn) has no file


def test_the_record_names_each_layer_files_module(saved):
    folder, expected = saved
    ckpt = SavedCheckpoint(str(folder / "ckpt" / "t"))
    assert recorded_layers(ckpt) == {0: "tied_modules.embed", 1: "tied_modules.mix", 2: "2", 3: "3",
                                     4: "tied_modules.mix"}
    assert pipeline_layers(ckpt).keys() == expected.keys()
    # control: without the recorded names, the wholly frozen tied module is read under its layer indices
    with mock.patch("deepspeed_bnb.checkpoint.format.weights.recorded_layers", return_value={}):
        inferred = pipeline_layers(ckpt, known=_known(ckpt))
    assert "1.lin.weight" in inferred and not any(name.startswith(FROZEN_TIED) for name in inferred)
    assert "tied_modules.embed.emb.weight" in inferred  # a trained tied module is recognised either way


def test_export_gives_the_engines_whole_state_dict(saved):
    from safetensors.torch import load_file
    folder, expected = saved
    assert main(["export", str(folder / "ckpt"), str(folder / "weights")]) == 0
    weights = load_file(str(folder / "weights" / "model.safetensors"))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_the_universal_export_gives_a_loader_the_frozen_layer_and_buffers(saved):
    folder, expected = saved
    assert main(["export", str(folder / "ckpt"), str(folder / "universal"), "--universal"]) == 0
    loader = build(seed=1, universal=True)
    own = state(loader)
    kept = [name for name in expected if name.startswith((FROZEN_LAYER, FROZEN_TIED))]
    assert kept and all(not torch.equal(own[name], expected[name]) for name in kept)  # control: seed 1's differ
    loader.load_checkpoint(str(folder / "universal"))
    loaded = state(loader)
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def mixed_through(module, h):  # a forward_fn: the tied module's layer becomes a partial, with no layer file
    return module(h)


def test_a_tied_module_used_only_through_forward_fn_is_named_at_initialize(one_rank, tmp_path, caplog):
    """DeepSpeed writes no layer file for a tied module whose every spec has a forward_fn: its frozen parameters are
    in no checkpoint (a load keeps the loader's values, checked), and initialize says so, naming them. Controls: the
    module above (tied without a forward_fn, frozen whole) is saved and not named; a trained-only one is not named."""
    import logging

    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.utils import logger

    def engine(seed, specs, frozen=(FROZEN_TIED,)):
        torch.manual_seed(seed)
        model = PipelineModule(specs, num_stages=1, loss_fn=pipeline_loss, partition_method="uniform")
        logger.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
                built = engine_of(model, frozen, 1, lr=1e-3)
        finally:
            logger.removeHandler(caplog.handler)
        said = [r.getMessage() for r in caplog.records if "writes no layer file" in r.getMessage()]
        caplog.clear()
        return built, said

    def specs():
        return [TiedLayerSpec("embed", Embed), TiedLayerSpec("mix", Mix, forward_fn=mixed_through),
                LayerSpec(Block, 32), TiedLayerSpec("mix", Mix, forward_fn=mixed_through),
                TiedLayerSpec("embed", Embed, forward_fn=tied_head)]

    saver, said = engine(0, specs())
    assert len(said) == 1 and "'tied_modules.mix'" in said[0] and "['lin.weight', 'lin.bias']" in said[0]
    train(saver, range(2))
    saver.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    loader, _ = engine(1, specs())
    own = state(loader)
    loader.load_checkpoint(str(tmp_path / "ckpt"))
    saved, loaded = state(saver), state(loader)
    mixed = [name for name in saved if name.startswith(FROZEN_TIED)]
    assert mixed and all(not torch.equal(saved[name], own[name]) for name in mixed)  # the seeds differ
    assert all(torch.equal(loaded[name], own[name]) for name in mixed)  # what the warning says: the loader's kept
    assert torch.equal(loaded["tied_modules.embed.emb.weight"], saved["tied_modules.embed.emb.weight"])  # trained

    saved_whole = [TiedLayerSpec("embed", Embed), TiedLayerSpec("mix", Mix), LayerSpec(Block, 32),
                   TiedLayerSpec("mix", Mix, forward_fn=mixed_through),
                   TiedLayerSpec("embed", Embed, forward_fn=tied_head)]
    assert engine(2, saved_whole)[1] == []  # control: one spec without a forward_fn, a layer file holds the module
    assert engine(3, specs(), frozen=())[1] == []  # control: nothing of it frozen, the master weights hold it all
