"""The offline tools (`deepspeed-bnb inspect|reshape|export|convert`), each against an independent reference.

- reshape 1 -> 3 -> 2, then loading the result at DP=1, gives back every byte of state (reference: the saving engine);
- export's weights equal DeepSpeed's own zero_to_fp32 reconstruction; its optimizer state equals a dequantization
  written here from the bnb formula;
- convert reads a stock DeepSpeed torch.optim.AdamW checkpoint: to bnb 32-bit state exactly, to 8-bit within one
  code step of torch's moments (half a step, measured); 8-bit -> 32-bit is exact dequantization; engines load the
  results and keep training; a stock ZeRO-3 checkpoint without Adam's moments is refused by name.
"""

import json
import os
import subprocess
import sys

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.checkpoint.format.constants import FORMAT_VERSION
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.tools.convert import convert
from deepspeed_bnb.checkpoint.tools.export import export
from deepspeed_bnb.checkpoint.tools.reshape import reshape
from deepspeed_bnb.checkpoint.tools.summary import summary
from support.toy import MIN_8BIT_SIZE, build_engine, train_steps
from support.bnb_state import assert_holds_moments, assert_same as assert_same_state, flat_param_states, \
    stock_moments


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bnb")
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(3))
    engine.save_checkpoint(str(folder), tag="t")
    return str(folder), engine


def snapshot(engine):
    state = flat_param_states(engine)
    return {engine.optimizer.param_names[p]: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in state.items()}


def assert_same(a, b):
    """Two optimizer states by parameter name, every parameter's bit for bit."""
    assert a.keys() == b.keys()
    for name in a:
        assert_same_state(a[name], b[name], name)


def test_reshape_round_trip_is_lossless(saved, tmp_path):
    folder, engine = saved
    three = reshape(folder, str(tmp_path / "dp3"), 3, progress=False)
    assert SavedCheckpoint(three).dp == 3 and len([n for n in os.listdir(three) if "optim_states" in n]) == 3
    two = reshape(str(tmp_path / "dp3"), str(tmp_path / "dp2"), 2, progress=False)
    assert SavedCheckpoint(two).dp == 2
    fresh = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)
    fresh.load_checkpoint(str(tmp_path / "dp2"))
    assert_same(snapshot(fresh), snapshot(engine))
    for a, b in zip(fresh.optimizer.single_partition_of_fp32_groups, engine.optimizer.single_partition_of_fp32_groups):
        assert torch.equal(a, b)


def test_inspect_names_what_matters(saved):
    folder, _ = saved
    text = summary(folder, verify_checksums=True)
    for needle in (f"deepspeed_bnb record v{FORMAT_VERSION}", "manifest: v2", "SHA-256 verified",
                   "ZeRO stage 2, 1 data-parallel ranks",
                   "bitsandbytes.optim.adamw.AdamW8bit", "8-bit  fc1.weight  (301, 40)  12,040",
                   "fp32   head.bias  (97,)  97", "absmax1:block", "qmap1:whole", "state1:element", "step 3"):
        assert needle in text, needle


def test_export_matches_zero_to_fp32_and_bnb_formula(saved, tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    folder, engine = saved
    from deepspeed_bnb.runtime.recovery_script import reads_block_aligned
    from support.toy import gathered_weights
    written = export(folder, str(tmp_path / "out"), optimizer_state=True, progress=False)
    weights = load_file(written["model"])
    if reads_block_aligned():
        reference = get_fp32_state_dict_from_zero_checkpoint(folder)
    else:  # before DeepSpeed 0.19.7 zero_to_fp32 cannot read the block-aligned layout: it stops
        with pytest.raises(ValueError, match="numels out of .* something is wrong"):
            get_fp32_state_dict_from_zero_checkpoint(folder)
        reference = gathered_weights(engine)  # the saving engine's weights, the same fp32 values
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in weights)
    state = load_file(written["optimizer"])
    for name, s in snapshot(engine).items():
        shape = weights[name].shape
        if s["state1"].dtype == torch.uint8:
            block = torch.arange(s["state1"].numel()) // 256
            exp_avg = s["qmap1"][s["state1"].long()] * s["absmax1"][block]
            exp_avg_sq = s["qmap2"][s["state2"].long()] * s["absmax2"][block]
        else:
            exp_avg, exp_avg_sq = s["state1"], s["state2"]
        assert torch.equal(state[f"{name}.exp_avg"], exp_avg.reshape(shape)), name
        assert torch.equal(state[f"{name}.exp_avg_sq"], exp_avg_sq.reshape(shape)), name
        assert state[f"{name}.step"].item() == 3
    with open(written["param_groups"]) as f:
        assert json.load(f)["param_groups"][1]["lr"] == 5e-4


@pytest.fixture(scope="module")
def stock_adamw(one_rank, tmp_path_factory):
    folder = tmp_path_factory.mktemp("stock")
    engine = build_engine(torch.optim.AdamW, stock=True)
    train_steps(engine, range(3))
    engine.save_checkpoint(str(folder), tag="s")
    return str(folder), stock_moments(engine), train_steps(engine, range(3, 6))


def test_convert_stock_adamw_to_bnb_32bit_is_exact(stock_adamw, tmp_path):
    folder, moments, continued = stock_adamw
    report = convert(folder, str(tmp_path / "c32"), "32bit", progress=False)
    assert "0 with 8-bit state" in report
    engine = build_engine(bnb.optim.AdamW, seed=1)
    engine.load_checkpoint(str(tmp_path / "c32"))
    for name, s in snapshot(engine).items():
        assert torch.equal(s["state1"], moments[name][0])
        assert torch.equal(s["state2"], moments[name][1])
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued)) < 1e-4  # bnb vs torch AdamW


def test_convert_refuses_param_groups_for_a_checkpoint_that_keeps_its_own(stock_adamw, saved, tmp_path):
    """--param-groups is for elastic stock checkpoints only: a rigid stock one and one of ours keep each group's
    hyper-parameters, and giving others is refused by name before anything is written."""
    for folder in (stock_adamw[0], saved[0]):
        with pytest.raises(ValueError, match="--param-groups is for elastic stock ZeRO-1/2 checkpoints"):
            convert(folder, str(tmp_path / "out"), "8bit", progress=False, param_groups=[{"lr": 1.0}] * 2)
        assert not (tmp_path / "out").exists()


def test_convert_stock_adamw_to_8bit_within_one_code_step(stock_adamw, tmp_path):
    folder, moments, continued = stock_adamw
    report = convert(folder, str(tmp_path / "c8"), "8bit", min_8bit_size=MIN_8BIT_SIZE, progress=False)
    assert "4 with 8-bit state" in report and "0.500 of one quantization step" in report  # nearest code: half
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE)
    engine.load_checkpoint(str(tmp_path / "c8"))
    for name, s in snapshot(engine).items():
        assert_holds_moments(s, moments[name], name)
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued)) < 1e-2


def test_convert_joins_a_stock_zero3_checkpoints_sub_groups(one_rank, tmp_path):
    """A stock ZeRO-3 run whose param groups are split into several sub-groups (`sub_group_size`): convert to bnb's
    32-bit AdamW gives every parameter DeepSpeed's own moments (safe_get_full_optimizer_state) and each param group its
    hyper-parameters, in an engine of one sub-group per param group."""
    from deepspeed.utils import safe_get_full_optimizer_state
    from support.bnb_state import engine_param_states
    stock = build_engine(torch.optim.AdamW, stock=True, stage=3, zero={"sub_group_size": 2000})
    assert len(stock.optimizer.fp16_groups) > 2  # the toy's two param groups in more sub-groups than that
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "stock"), tag="s")
    moments = {name: [safe_get_full_optimizer_state(p, key).reshape(-1).clone() for key in ("exp_avg", "exp_avg_sq")]
               for name, p in stock.module.named_parameters()}
    convert(str(tmp_path / "stock"), str(tmp_path / "c32"), "32bit", progress=False)
    engine = build_engine(bnb.optim.AdamW, seed=1, lr=5e-2, stage=3)
    engine.load_checkpoint(str(tmp_path / "c32"))
    for name, state in engine_param_states(engine).items():
        assert torch.equal(state["state1"].reshape(-1), moments[name][0]), name
        assert torch.equal(state["state2"].reshape(-1), moments[name][1]), name
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-3, 5e-4]  # the stock run's, not the builder's


@pytest.mark.parametrize("dp", [1, 3])
def test_a_stage3_engine_loads_a_zero2_checkpoint_reshaped_for_stage3(saved, tmp_path, dp):
    """reshape of a ZeRO-2 checkpoint (whole weights in its model states) for ZeRO-3 writes DeepSpeed's stage-3 model
    states (an empty placeholder per parameter), which a ZeRO-3 engine loads: every parameter's state and weights as
    the saving engine held them (from 3 ranks' files too)."""
    from support.bnb_state import engine_param_states
    from support.toy import gathered_weights
    folder, engine = saved
    reshape(folder, str(tmp_path / "stage3"), dp, progress=False, stage=3)
    fresh = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, stage=3)
    fresh.load_checkpoint(str(tmp_path / "stage3"))
    assert_same(engine_param_states(fresh), snapshot(engine))
    expected = gathered_weights(engine)
    assert all(torch.equal(weights, expected[name]) for name, weights in gathered_weights(fresh).items())


def test_convert_takes_an_elastic_stock_checkpoints_hyperparameters_from_the_user(one_rank, tmp_path):
    """An elastic stock ZeRO-1 checkpoint (elastic_checkpoint: true) keeps no param group hyper-parameters: convert
    refuses to guess them (it gave every group the target class's defaults before), and with --param-groups writes
    those given, the moments the stock run's."""
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    stock = build_engine(torch.optim.AdamW, stock=True, stage=1, zero={"elastic_checkpoint": True})
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "elastic"), tag="e")
    moments = {name: pair[0] for name, pair in stock_moments(stock).items()}
    with pytest.raises(CheckpointMismatchError, match="elastic_checkpoint: true.*--param-groups, a JSON list of 2"):
        convert(str(tmp_path / "elastic"), str(tmp_path / "guessed"), "32bit", progress=False)
    with pytest.raises(ValueError, match="gives 1 param group"):
        convert(str(tmp_path / "elastic"), str(tmp_path / "one"), "32bit", progress=False, param_groups=[{}])
    given = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 5e-4, "weight_decay": 0.0}]  # the run's (support.toy)
    convert(str(tmp_path / "elastic"), str(tmp_path / "c32"), "32bit", progress=False, param_groups=given)
    written = SavedCheckpoint(str(tmp_path / "c32"))
    assert [{k: g["hyperparams"][k] for k in ("lr", "weight_decay")} for g in written.groups] == given
    engine = build_engine(bnb.optim.AdamW, seed=1, lr=5e-2, stage=1)
    engine.load_checkpoint(str(tmp_path / "c32"))
    for name, s in snapshot(engine).items():
        assert torch.equal(s["state1"], moments[name].reshape(s["state1"].shape)), name
    assert [(g["lr"], g["weight_decay"]) for g in engine.optimizer.param_groups] == [(1e-3, 0.1), (5e-4, 0.0)]


class Tied(torch.nn.Module):
    """An embedding tied to the output head (DeepSpeed saves the head's name in shared_params)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid = torch.nn.Embedding(97, 40), torch.nn.Linear(40, 40)
        self.head = torch.nn.Linear(40, 97, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.mid(self.emb(tokens))))


def test_a_stage3_engine_loads_a_tied_model_reshaped_for_stage3(one_rank, tmp_path):
    """The tied name (shared_params) is a parameter too: a ZeRO-2 checkpoint of a tied model reshaped for ZeRO-3 loads
    into a ZeRO-3 engine with the saved weights (its whole tensor under the tied name failed the load)."""
    import deepspeed

    from support.toy import ds_config, gathered_weights

    def engine_of(seed, stage):
        torch.manual_seed(seed)
        model = Tied()
        optimizer = bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=MIN_8BIT_SIZE)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=stage))[0]

    saving = engine_of(0, 2)
    for step in range(2):
        tokens = torch.randint(0, 97, (8, 16), generator=torch.Generator().manual_seed(step))
        saving.backward(torch.nn.functional.cross_entropy(saving(tokens).reshape(-1, 97), tokens.reshape(-1)))
        saving.step()
    saving.save_checkpoint(str(tmp_path / "tied"), tag="t")
    reshape(str(tmp_path / "tied" / "t"), str(tmp_path / "stage3"), 1, progress=False, stage=3)
    loading = engine_of(1, 3)
    loading.load_checkpoint(str(tmp_path / "stage3"))
    expected = gathered_weights(saving)
    assert all(torch.equal(weights, expected[name]) for name, weights in gathered_weights(loading).items())


def test_convert_refuses_a_stock_zero3_checkpoint_without_adam_state(one_rank, tmp_path):
    """A stock ZeRO-3 checkpoint of another torch optimizer (SGD with momentum) is refused by name for an Adam class,
    naming the rule whose class would take it, and nothing is written (the 2-rank ZeRO-3 AdamW conversion:
    tests/distributed/test_convert_zero3.py; into bnb's SGD8bit: tests/unit/test_convert_stock_on_load.py)."""
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    engine = build_engine(torch.optim.SGD, stock=True, stage=3, momentum=0.9)
    train_steps(engine, range(1))
    engine.save_checkpoint(str(tmp_path / "sgd"), tag="s")
    with pytest.raises(CheckpointMismatchError,
                       match=r"\['momentum_buffer'\].*keeps exp_avg, exp_avg_sq.*'momentum' update rule"):
        convert(str(tmp_path / "sgd"), str(tmp_path / "out"), "8bit", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant, needle", [
    ({"amsgrad": True}, r"\{'amsgrad': \"AMSGrad's"),
    ({"weight_decay": 0.1, "plain_adam": True}, r"\{'weight_decay': 'weight decay added to the gradient"),
    ({"cpu_adam": True, "bias_correction": False}, r"\{'bias_correction': \"no bias correction")])
def test_convert_refuses_a_torch_adam_variant_bnb_does_not_step(one_rank, tmp_path, variant, needle):
    """A stock run of torch's AdamW with amsgrad, of torch's Adam with weight decay (added to the gradient, where bnb's
    every Adam decays the weights as AdamW does) or of DeepSpeedCPUAdam without bias correction would go on under
    another rule as bnb AdamW8bit: refused, naming the setting, nothing written (torch's plain AdamW converts:
    test_convert_reads_a_stock_run_... below)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    kwargs = dict(variant)
    cls = torch.optim.Adam if kwargs.pop("plain_adam", False) else torch.optim.AdamW
    cls = DeepSpeedCPUAdam if kwargs.pop("cpu_adam", False) else cls
    stock = build_engine(cls, stock=True, **kwargs)
    train_steps(stock, range(1))
    stock.save_checkpoint(str(tmp_path / "torch"), tag="t")
    with pytest.raises(ValueError, match=needle):
        convert(str(tmp_path / "torch"), str(tmp_path / "out"), "8bit", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage, optimizer", [(2, "AdamW8bit"), (3, "AdamW8bit"), (2, "AdamW")])
def test_convert_reads_a_stock_run_of_bnb_adamw8bit(one_rank, tmp_path, stage, optimizer):
    """A run of bnb AdamW8bit under stock DeepSpeed (ZeRO-2, ZeRO-3; and of bnb's 32-bit AdamW) keeps bnb's whole state
    of each flat partition per rank: convert gives every parameter those codes dequantized, exactly (to bnb's
    32-bit AdamW), and within one code step of them in deepspeed_bnb's block-aligned 8-bit layout, whose engine
    continues as the stock run does. Reference: the stock engine's live state (stock_moments). Controls: the codes
    are not the moments (the 32-bit result differs from them); a stock run of Lion8bit (one state) for an Adam class
    is refused by name, nothing written. (Before this, convert refused every stock run of a bitsandbytes optimizer.)"""
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    from support.bnb_state import engine_param_states
    stock = build_engine(getattr(bnb.optim, optimizer), stock=True, stage=stage, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(3))
    stock.save_checkpoint(str(tmp_path / "stock"), tag="s")
    moments = stock_moments(stock)
    continued = train_steps(stock, range(3, 6))

    convert(str(tmp_path / "stock"), str(tmp_path / "c32"), "32bit", progress=False)
    wide = build_engine(bnb.optim.AdamW, seed=1, stage=stage)
    wide.load_checkpoint(str(tmp_path / "c32"))
    states = engine_param_states(wide)
    assert states.keys() == moments.keys()
    for name, state in states.items():
        assert torch.equal(state["state1"].reshape(-1), moments[name][0]), name
        assert torch.equal(state["state2"].reshape(-1), moments[name][1]), name
    assert all(not torch.equal(s["state1"], s["state1"].round()) for s in states.values())  # control: moments, not
    # codes read as numbers

    report = convert(str(tmp_path / "stock"), str(tmp_path / "c8"), "8bit", min_8bit_size=MIN_8BIT_SIZE,
                     progress=False)
    assert "of one quantization step" in report
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, stage=stage)
    engine.load_checkpoint(str(tmp_path / "c8"))
    quantized = sum(assert_holds_moments(s, moments[name], name) for name, s in engine_param_states(engine).items())
    assert quantized > 0
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued)) < 1e-2

    lion = build_engine(bnb.optim.Lion8bit, stock=True, stage=stage, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(lion, range(1))
    lion.save_checkpoint(str(tmp_path / "lion"), tag="s")
    with pytest.raises(CheckpointMismatchError, match=r"bitsandbytes optimizer with one state \(Lion"):
        convert(str(tmp_path / "lion"), str(tmp_path / "out"), "8bit", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rule, eight, wide", [("lion", "Lion8bit", "Lion"), ("ademamix", "AdEMAMix8bit", "AdEMAMix")])
def test_a_deepspeed_bnb_checkpoint_of_another_rule_switches_precision(one_rank, tmp_path, rule, eight, wide):
    """convert --to 32bit of a deepspeed_bnb Lion8bit (one state) or AdEMAMix8bit (two EMAs as the rows of state1,
    then state2) checkpoint for bnb's 32-bit class of the rule: every state the codes dequantized by bitsandbytes,
    exactly, row by row. Control: the same for an AdamW class is refused, naming the rule."""
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    from support.bnb_state import bnb_moments, engine_param_states
    engine = build_engine(getattr(bnb.optim, eight), min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(2))
    engine.save_checkpoint(str(tmp_path / "ours"), tag="t")
    saved = engine_param_states(engine)
    convert(str(tmp_path / "ours"), str(tmp_path / "fp32"), "32bit", optimizer_class=f"bitsandbytes.optim.{wide}",
            progress=False)
    fp32 = build_engine(getattr(bnb.optim, wide), seed=1)
    fp32.load_checkpoint(str(tmp_path / "fp32"))
    eight_bit = 0
    for name, state in engine_param_states(fp32).items():
        keys = sorted(key for key in state if key.startswith("state"))
        assert keys == sorted(key for key in saved[name] if key.startswith("state")), name
        numel = state[keys[-1]].shape[-1]  # the last state has one row
        expected = bnb_moments(saved[name], numel)
        for key in keys:
            assert state[key].dtype == torch.float32, (name, key)
            eight_bit += saved[name][key].dtype == torch.uint8
            assert torch.equal(state[key].reshape(-1, numel), expected[key]), (name, key)
    assert eight_bit
    with pytest.raises(CheckpointMismatchError, match=rf"holds '{rule}' state.*give a class of '{rule}'"):
        convert(str(tmp_path / "ours"), str(tmp_path / "adam"), "32bit", progress=False)


def test_convert_refuses_the_moments_of_a_stock_elastic_bnb_checkpoint_by_name(one_rank, tmp_path):
    """DeepSpeed's elastic ZeRO-1/2 save drops the last `padding` entries of every state tensor of a padded partition:
    of bnb's codes, but also of its per-block scales and maps, so the last blocks' scales are gone. convert refuses
    such moments, naming the file, what is missing and the fix, and writes nothing; the weights still load (the
    fix it names). Control: the saved absmax really is short of the codes' blocks."""
    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    from support.toy import gathered_weights
    stock = build_engine(bnb.optim.AdamW8bit, stock=True, stage=1, zero={"elastic_checkpoint": True},
                         min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "elastic"), tag="e")
    saved = SavedCheckpoint(str(tmp_path / "elastic")).optimizer_state(0)["base_optimizer_state"]
    assert any(s["absmax1"].numel() < -(-s["state1"].numel() // 256) for s in saved if s["state1"].dtype == torch.uint8)
    groups = [{"lr": 1e-3, "weight_decay": 0.1}, {"lr": 5e-4, "weight_decay": 0.0}]
    with pytest.raises(CheckpointMismatchError, match=r"optim_states.pt: bitsandbytes 8-bit state1 of .* codes needs "
                                                      r"absmax1 of at least .*elastic_checkpoint: true.*"
                                                      r"load_optimizer_states=False"):
        convert(str(tmp_path / "elastic"), str(tmp_path / "out"), "8bit", progress=False, param_groups=groups)
    assert not (tmp_path / "out").exists()
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, stage=1)
    engine.load_checkpoint(str(tmp_path / "elastic"), load_optimizer_states=False)
    expected = gathered_weights(stock)
    assert all(torch.equal(w, expected[n]) for n, w in gathered_weights(engine).items())


def test_convert_8bit_to_32bit_is_exact_dequantization(saved, tmp_path):
    folder, engine = saved
    convert(folder, str(tmp_path / "up"), "32bit", progress=False)
    wide = build_engine(bnb.optim.AdamW, seed=1)
    wide.load_checkpoint(str(tmp_path / "up"))
    exported = load_file(export(folder, str(tmp_path / "ref"), optimizer_state=True, progress=False)["optimizer"])
    for name, s in snapshot(wide).items():
        assert torch.equal(s["state1"], exported[f"{name}.exp_avg"].flatten())
        assert torch.equal(s["state2"], exported[f"{name}.exp_avg_sq"].flatten())
    train_steps(wide, range(3, 5))


def test_format_constants_are_deepspeeds():
    from deepspeed.checkpoint import constants as ds
    from deepspeed_bnb.checkpoint.format import constants as ours
    assert ours.BASE_OPTIMIZER_STATE_KEY == ds.BASE_OPTIMIZER_STATE
    assert ours.MASTER_WEIGHTS_KEY == ds.SINGLE_PARTITION_OF_FP32_GROUPS


def test_cli_help_and_errors(tmp_path, capsys):
    from deepspeed_bnb.cli import main
    for command in ("inspect", "reshape", "export", "convert"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0 and "checkpoint" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err
    assert "nowhere" in error and "latest" in error
    with pytest.raises(SystemExit):
        main(["reshape", str(tmp_path), str(tmp_path / "o")])  # --dp is required
    assert "--dp" in capsys.readouterr().err
    for groups in ("[{lr: 1}]", "{}", "[1]"):  # not JSON; not a list; not objects
        assert main(["convert", str(tmp_path), str(tmp_path / "o"), "--to", "8bit", "--param-groups", groups]) == 2
        assert "--param-groups" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "deepspeed_bnb", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "inspect" in done.stdout and "convert" in done.stdout


def test_cli_runs_the_tools(saved, tmp_path, capsys):
    from deepspeed_bnb.cli import main
    folder, _ = saved
    assert main(["reshape", folder, str(tmp_path / "r"), "--dp", "2", "--quiet"]) == 0
    assert main(["inspect", str(tmp_path / "r")]) == 0 and "2 data-parallel ranks" in capsys.readouterr().out
    assert main(["export", folder, str(tmp_path / "e"), "--quiet"]) == 0
    assert os.path.isfile(tmp_path / "e" / "model.safetensors")


# ---- ZeRO-3 checkpoints ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved3(one_rank, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bnb3")
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, stage=3)
    train_steps(engine, range(3))
    engine.save_checkpoint(str(folder), tag="t")
    return str(folder), engine


def test_stage3_inspect_export_reshape_and_convert(saved3, tmp_path):
    """inspect names the stage; export's weights are DeepSpeed's zero_to_fp32 reconstruction; reshape to 3 ranks of
    stage 3, then to 2 ranks of stage 2, loads back into a stage-3 engine byte-identical; convert to 32-bit loads into
    a stage-3 engine of bnb's 32-bit AdamW with the dequantized moments."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from support.bnb_state import engine_param_states as states
    from support.toy import gathered_weights as weights
    folder, engine = saved3
    text = summary(folder, verify_checksums=True)
    assert "ZeRO stage 3, 1 data-parallel ranks" in text and "8-bit  fc1.weight  (301, 40)  12,040" in text
    exported = load_file(export(folder, str(tmp_path / "out"), progress=False)["model"])
    reference = get_fp32_state_dict_from_zero_checkpoint(folder)
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in exported)

    three = reshape(folder, str(tmp_path / "dp3"), 3, progress=False)
    assert SavedCheckpoint(three).zero_stage == 3
    assert sorted(n for n in os.listdir(three) if "model_states" in n) == \
        [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(3)]
    two = reshape(str(tmp_path / "dp3"), str(tmp_path / "dp2"), 2, progress=False, stage=2)
    assert SavedCheckpoint(two).zero_stage == 2 and "mp_rank_00_model_states.pt" in os.listdir(two)
    fresh = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, stage=3)
    fresh.load_checkpoint(str(tmp_path / "dp2"))
    expected, got = states(engine), states(fresh)
    assert_same(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(weights(fresh).values(), weights(engine).values()))

    convert(folder, str(tmp_path / "up"), "32bit", progress=False)
    up = build_engine(bnb.optim.AdamW, seed=1, stage=3)
    up.load_checkpoint(str(tmp_path / "up"))
    for name, s in expected.items():
        moments = states(up)[name]
        if s["state1"].dtype == torch.uint8:
            block = torch.arange(s["state1"].numel()) // 256
            assert torch.equal(moments["state1"], s["qmap1"][s["state1"].long()] * s["absmax1"][block]), name
        else:
            assert torch.equal(moments["state1"], s["state1"]), name
    train_steps(up, range(3, 4))  # and it trains on
