"""The 8-bit universal checkpoint: `deepspeed-bnb export --universal` keeps every parameter's bnb state as it is.

Against the saved checkpoint itself (read through SavedCheckpoint, whose per-parameter state test_matches_bnb.py holds
to plain bitsandbytes): each parameter's state read back from the universal folder is the saved state bit for bit, for
Adam's two moments, Lion's one, AdEMAMix's three rows and the 32-bit state of small parameters; a conversion back into
ZeRO files keeps it bit for bit; an engine of ours with `load_universal` loads it at ZeRO 1, 2 and 3 with the state bit
for bit and then trains exactly as the uninterrupted run does; the state files are at most 0.3x the bytes of the fp32
(stock) kind's for a model of realistic parameter sizes. Controls: the stock kind of the same checkpoint is not bit for
bit (its moments are requantized on the way back: the resumed losses differ, slightly), and a stock engine is refused on
the 8-bit kind instead of starting fresh moments.
Buffers and frozen parameters (which zero/ does not hold) come back from its model states into an engine of ours built
with other values, at the saving stage and another.
DeepSpeed's own converter (ds_to_universal.main, called in-process as DeepSpeed's tests call it) writes the 8-bit kind
for a checkpoint of ours while deepspeed_bnb is imported (control: DeepSpeed's original fails on it) and still
converts a stock checkpoint itself.
"""

import os
import shutil
from types import SimpleNamespace

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb import installer
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.tools.convert import convert
from deepspeed_bnb.checkpoint.tools.export import export
from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint
from support.bnb_state import assert_same
from support.toy import MIN_8BIT_SIZE, build_engine, ds_config, freeze, make_model, param_groups, train_steps

STEPS = 3
OPTIMIZERS = {
    "AdamW8bit": dict(optimizer_cls=bnb.optim.AdamW8bit),
    "Lion8bit": dict(optimizer_cls=bnb.optim.Lion8bit),
    "AdEMAMix8bit": dict(optimizer_cls=bnb.optim.AdEMAMix8bit, t_alpha=5, t_beta3=5),
}


def same_states(a, b, label):
    assert len(a) == len(b), label
    for i, (x, y) in enumerate(zip(a, b)):
        assert_same(x, y, f"{label}, parameter {i}")


MORE = range(STEPS, STEPS + 3)  # the steps a resumed run takes
CONTINUED = {}  # optimizer -> the losses of the uninterrupted run over MORE


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    folders = {}
    for name, kwargs in OPTIMIZERS.items():
        folder = str(tmp_path_factory.mktemp(name))
        engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, lr=1e-2, **kwargs)
        train_steps(engine, range(STEPS))
        engine.save_checkpoint(folder, tag="t")
        folders[name] = folder
        CONTINUED[name] = train_steps(engine, MORE)
    return folders


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_parameters_state_comes_back_bit_for_bit(saved, tmp_path, name):
    out = str(tmp_path / "universal")
    export(saved[name], out, universal=True, progress=False)
    ckpt, universal = SavedCheckpoint(saved[name]), UniversalCheckpoint(out)
    assert universal.optimizer_name == ckpt.record(0)["optimizer_name"]
    kinds = set()
    for g in range(len(ckpt.param_shapes())):
        mine, theirs = universal.param_states(g), ckpt.param_states(g)
        same_states(mine, theirs, f"group {g}")
        kinds |= {state.eight_bit for state in mine}
        for got, want in zip(universal.master_weights(g), ckpt.master_weights(g)):
            assert torch.equal(got, want.float())
    assert kinds == {True, False}  # 8-bit and 32-bit parameters both exercised
    if name == "AdEMAMix8bit":
        assert any(state["state1"].dim() == 2 for state in universal.param_states(0))


CLASSES = {"AdamW8bit": "bitsandbytes.optim.adamw.AdamW8bit", "Lion8bit": "bitsandbytes.optim.lion.Lion8bit",
           "AdEMAMix8bit": "bitsandbytes.optim.ademamix.AdEMAMix8bit"}


@pytest.mark.parametrize("name,kind", [("AdamW8bit", "8bit"), ("Lion8bit", "8bit"), ("AdEMAMix8bit", "8bit"),
                                       ("AdamW8bit", "stock")])
def test_converted_back_the_8bit_kind_is_bit_for_bit_and_the_stock_kind_is_not(saved, tmp_path, name, kind):
    out, back = str(tmp_path / "universal"), str(tmp_path / "back")
    export(saved[name], out, universal=True, stock=kind == "stock", progress=False)
    report = convert(out, back, "8bit", optimizer_class=CLASSES[name], min_8bit_size=MIN_8BIT_SIZE, progress=False)
    ckpt, again = SavedCheckpoint(saved[name]), SavedCheckpoint(back)
    params = sum(len(shapes) for shapes in ckpt.param_shapes())
    if kind == "8bit":
        assert f"{params} kept as saved, bit for bit" in report, report
        for g in range(len(ckpt.param_shapes())):
            same_states(again.param_states(g), ckpt.param_states(g), f"group {g}")
    else:  # control: the fp32 moments are quantized again, so some 8-bit state differs
        assert "kept as saved" not in report
        with pytest.raises(AssertionError):
            for g in range(len(ckpt.param_shapes())):
                same_states(again.param_states(g), ckpt.param_states(g), f"group {g}")


def test_the_8bit_kind_of_ademamix_converts_to_32bit_row_by_row(saved, tmp_path):
    """An 8-bit universal checkpoint of AdEMAMix8bit for bnb's 32-bit AdEMAMix: not kept as saved (another
    precision), so its 8-bit parameters go through their moments: state1's two rows and state2 are the codes
    dequantized by bitsandbytes itself, exactly (the 32-bit ones are kept as saved). (Before, only Adam's two moments
    went this way and AdEMAMix was refused.)"""
    from support.bnb_state import bnb_moments
    out, back = str(tmp_path / "universal"), str(tmp_path / "back")
    export(saved["AdEMAMix8bit"], out, universal=True, progress=False)
    report = convert(out, back, "32bit", optimizer_class="bitsandbytes.optim.ademamix.AdEMAMix", progress=False)
    assert "0 with 8-bit state" in report, report  # the 8-bit parameters went through their moments
    ckpt, wide = SavedCheckpoint(saved["AdEMAMix8bit"]), SavedCheckpoint(back)
    eight_bit = 0
    for g in range(len(ckpt.param_shapes())):
        for theirs, mine in zip(ckpt.param_states(g), wide.param_states(g)):
            numel = theirs["state2"].shape[-1]
            expected = bnb_moments(theirs, numel)
            eight_bit += theirs.eight_bit
            for key in ("state1", "state2"):
                assert mine[key].dtype == torch.float32
                assert torch.equal(mine[key].reshape(-1, numel), expected[key]), key
    assert eight_bit


def state_bytes(folder):
    """Bytes of the optimizer-state files of a universal checkpoint (all but the weights and model states)."""
    total = 0
    for root, _, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if f.endswith(".pt") and f != "fp32.pt" and "model_states" not in f)
    return total


def test_the_8bit_kind_is_under_a_third_of_the_stock_kinds_bytes(one_rank, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(model.parameters(), lr=1e-3),
                                  config=ds_config(1))[0]
    for _ in range(2):
        loss = engine(torch.randn(4, 256)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    export(str(tmp_path / "ckpt"), str(tmp_path / "eight"), universal=True, progress=False)
    export(str(tmp_path / "ckpt"), str(tmp_path / "stock"), universal=True, stock=True, progress=False)
    ratio = state_bytes(tmp_path / "eight") / state_bytes(tmp_path / "stock")
    print(f"8-bit / fp32 universal state bytes: {ratio:.3f}")
    assert 0.2 < ratio <= 0.3


def universal_engine(name, stage):
    model = make_model(1)  # other weights than the saved run's: the load must replace them
    optimizer = OPTIMIZERS[name]["optimizer_cls"](param_groups(model, lr=1e-2), min_8bit_size=MIN_8BIT_SIZE,
                                                  **{k: v for k, v in OPTIMIZERS[name].items() if k != "optimizer_cls"})
    config = {**ds_config(1, stage=stage), "checkpoint": {"load_universal": True}}
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


@pytest.mark.parametrize("name,stage", [("AdamW8bit", 2), ("AdamW8bit", 3), ("Lion8bit", 1), ("AdEMAMix8bit", 2)])
def test_an_engine_of_ours_loads_the_8bit_kind_and_tracks_the_uninterrupted_run(saved, tmp_path, name, stage):
    out = str(tmp_path / "universal")
    export(saved[name], out, universal=True, progress=False)
    engine = universal_engine(name, stage)
    engine.load_checkpoint(out)
    assert not [n for n in os.listdir(out) if n.startswith(".")], "the scratch tag is removed"
    engine.save_checkpoint(str(tmp_path / "again"), tag="t")  # what the engine holds now, read back
    ckpt, again = SavedCheckpoint(saved[name]), SavedCheckpoint(str(tmp_path / "again"))
    for g in range(len(ckpt.param_shapes())):
        same_states(again.param_states(g), ckpt.param_states(g), f"group {g}")
        for got, want in zip(again.master_weights(g), ckpt.master_weights(g)):
            assert torch.equal(got.float(), want.float())
    assert train_steps(engine, MORE) == CONTINUED[name]  # bit for bit: same state, same stage family at DP 1


def test_a_per_parameter_precision_override_is_kept(one_rank, tmp_path):
    """A run whose embedding has 32-bit state by a bnb override (HF Trainer registers one for its 8-bit optimizers)
    loads back from its universal checkpoint into an engine with the same override: the scratch tag takes each
    parameter's precision from the engine, so every state comes back bit for bit (it gave the embedding 8-bit state
    by its size, and the load failed: "per-parameter state precision differs")."""
    saving = build_engine(min_8bit_size=MIN_8BIT_SIZE, emb32=True)
    train_steps(saving, range(2))
    saving.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    export(str(tmp_path / "ckpt"), str(tmp_path / "universal"), universal=True, progress=False)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, emb32=True, checkpoint={"load_universal": True})
    engine.load_checkpoint(str(tmp_path / "universal"))
    engine.save_checkpoint(str(tmp_path / "again"), tag="t")
    ckpt, again = SavedCheckpoint(str(tmp_path / "ckpt")), SavedCheckpoint(str(tmp_path / "again"))
    assert not all(state.eight_bit for state in ckpt.param_states(0))  # the override held at save
    for g in range(len(ckpt.param_shapes())):
        same_states(again.param_states(g), ckpt.param_states(g), f"group {g}")


def test_control_the_stock_kind_resumes_close_but_not_exactly(saved, tmp_path):
    out = str(tmp_path / "universal")
    export(saved["AdamW8bit"], out, universal=True, stock=True, progress=False)
    engine = universal_engine("AdamW8bit", 2)
    engine.load_checkpoint(out)  # its fp32 moments quantized again
    losses = train_steps(engine, MORE)
    assert losses != CONTINUED["AdamW8bit"]
    assert max(abs(a - b) for a, b in zip(losses, CONTINUED["AdamW8bit"])) < 1e-2


def test_a_stock_engine_is_refused_on_the_8bit_kind(saved, tmp_path):
    out = str(tmp_path / "universal")
    export(saved["AdamW8bit"], out, universal=True, progress=False)
    model = build_engine(stock=True).module  # any model of the toy's names
    config = {**ds_config(1), "checkpoint": {"load_universal": True}}
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=config)[0]
    with pytest.raises(Exception, match="--stock"):
        engine.load_checkpoint(out)


def converter_args(tag_dir: str, output_folder: str) -> SimpleNamespace:
    """The arguments DeepSpeed's universal-checkpoint tests hand ds_to_universal.main."""
    return SimpleNamespace(input_folder=tag_dir, output_folder=output_folder, num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)


def test_deepspeeds_converter_writes_the_8bit_kind_for_our_checkpoints(saved, tmp_path):
    """DeepSpeed's ds_to_universal.main, called in-process as DeepSpeed's own universal-checkpoint tests call it, on
    a checkpoint of ours: the 8-bit universal checkpoint beside it (`t_universal`), which an engine of ours loads by
    that tag with the state bit for bit and then trains as the uninterrupted run does; an output that is the source
    or inside it is refused. Control: DeepSpeed's own converter fails on the same checkpoint."""
    from deepspeed.checkpoint.ds_to_universal import main
    folder = str(tmp_path / "run")
    shutil.copytree(saved["AdamW8bit"], folder)
    for onto in (os.path.join(folder, "t"), os.path.join(folder, "t", "universal")):  # the source, or inside it
        with pytest.raises(ValueError, match="would replace the source"):
            main(converter_args(os.path.join(folder, "t"), onto))
    main(converter_args(os.path.join(folder, "t"), os.path.join(folder, "t_universal")))
    engine = universal_engine("AdamW8bit", 2)
    engine.load_checkpoint(folder, tag="t_universal")
    engine.save_checkpoint(str(tmp_path / "again"), tag="t")
    ckpt, again = SavedCheckpoint(saved["AdamW8bit"]), SavedCheckpoint(str(tmp_path / "again"))
    for g in range(len(ckpt.param_shapes())):
        same_states(again.param_states(g), ckpt.param_states(g), f"group {g}")
    assert train_steps(engine, MORE) == CONTINUED["AdamW8bit"]
    with pytest.raises(AssertionError, match="universal_checkpoint_info state is missing"):
        installer.stock("ds_to_universal.main")(converter_args(os.path.join(folder, "t"),
                                                               str(tmp_path / "stock_universal")))


def test_deepspeeds_converter_still_converts_stock_checkpoints(one_rank, tmp_path):
    """A stock DeepSpeed checkpoint (torch AdamW) goes to DeepSpeed's own converter: its universal folder holds torch
    Adam's fp32 moments per parameter, as DeepSpeed writes them."""
    from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.checkpoint.ds_to_universal import main
    model = build_engine().module  # the toy's model
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=ds_config(1))[0]
    train_steps(engine, range(2))
    engine.save_checkpoint(str(tmp_path), tag="s", client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    main(converter_args(str(tmp_path / "s"), str(tmp_path / "s_universal")))
    name = next(iter(dict(engine.module.named_parameters())))
    assert sorted(os.listdir(tmp_path / "s_universal" / "zero" / name)) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt",
                                                                            "step.pt"]


def frozen_buffer_engine(seed: int, stage: int, universal: bool = False):
    """The toy with a persistent buffer and frozen parameters (support.distributed_scenarios' FROZEN), one rank."""
    from support.distributed_scenarios import FROZEN
    model = make_model(seed)
    model.register_buffer("scale", torch.randn(5, generator=torch.Generator().manual_seed(seed)))
    for name, param in model.named_parameters():
        if name in FROZEN:  # values of their own per seed (the toy's layer norm starts at ones and zeros)
            param.data.normal_(generator=torch.Generator().manual_seed(seed))
    groups = freeze(model, FROZEN, param_groups(model))
    config = {**ds_config(1, stage=stage), **({"checkpoint": {"load_universal": True}} if universal else {})}
    optimizer = bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


@pytest.mark.parametrize("saved_stage,stage", [(2, 2), (3, 3), (3, 1), (1, 3)])
def test_the_universal_checkpoint_keeps_buffers_and_frozen_parameters(one_rank, tmp_path, saved_stage, stage):
    """What zero/ does not hold, the model states of the universal export do: a buffer and the frozen parameters come
    back in an engine of ours built with other values (a strict load of the module), at the saving stage and another;
    the trained weights are the saved master weights. A ZeRO-1 save records no frozen parameters (DeepSpeed writes
    frozen_param_shapes from stage 2 on): they are the module's tensors nothing else names."""
    from support.toy import gathered_weights
    engine = frozen_buffer_engine(0, saved_stage)
    train_steps(engine, range(STEPS))
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    expected = {**gathered_weights(engine), "scale": engine.module.scale.clone()}
    export(str(tmp_path / "ckpt" / "t"), str(tmp_path / "universal"), universal=True, progress=False)
    fresh = frozen_buffer_engine(1, stage, universal=True)
    assert not torch.equal(fresh.module.scale, expected["scale"])  # control: the loader starts elsewhere
    fresh.load_checkpoint(str(tmp_path / "universal"), load_module_strict=True)
    got = {**gathered_weights(fresh), "scale": fresh.module.scale}
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
