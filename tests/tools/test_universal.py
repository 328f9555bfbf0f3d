"""DeepSpeed universal checkpoints, both ways, against DeepSpeed's own converter and loader.

- Out: `deepspeed-bnb export --universal --stock` of an AdamW8bit checkpoint loads, through DeepSpeed's `load_universal`
  path, into a stock engine with torch.optim.AdamW at ZeRO stage 1, 2 and 3: every parameter's fp32 weights equal
  the saved master weights and exp_avg / exp_avg_sq equal bitsandbytes' own dequantization of the saved state, bit
  for bit; step and hyper-parameters come from the checkpoint; the engine trains on.
- In: a stock torch.optim.AdamW run, converted by DeepSpeed's ds_to_universal, then `convert --to 8bit`: an
  AdamW8bit engine loads it with the weights exact and every moment within half a quantization step of torch's
  (reported); exported back as a stock universal checkpoint (stock -> 8-bit -> stock), its moments are what the 8-bit
  state dequantizes to (so within half a step of torch's) and its weights torch's, exactly. Round trip 8-bit -> stock
  universal -> 8-bit: every moment within half a quantization step, weights exact.
- Control: DeepSpeed's ds_to_universal command line (which does not import deepspeed_bnb) fails on a deepspeed_bnb
  checkpoint (it cannot read bnb state).
"""

import os
import subprocess
import sys

import bitsandbytes as bnb
import deepspeed
import pytest
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

import deepspeed_bnb  # noqa: F401
from support.bnb_state import ROUNDING, bnb_moments
from conftest import without_launch_vars
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.tools.convert import convert
from deepspeed_bnb.checkpoint.tools.export import export
from deepspeed_bnb.cli import main
from deepspeed_bnb.ops.reference import code_gap
from support.bnb_state import flat_param_states
from support.toy import MIN_8BIT_SIZE, build_engine, ds_config, make_model, param_groups, train_steps

STEPS = 3


def torch_adamw_engine(stage, universal, lr=5e-2, seed=1):
    model = make_model(seed)
    optimizer = torch.optim.AdamW(param_groups(model, lr=lr), lr=lr)
    config = ds_config(1, stage=stage)
    config["checkpoint"] = {"load_universal": universal}
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


@pytest.fixture(scope="module")
def saved(one_rank, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bnb"))
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(STEPS))
    engine.save_checkpoint(folder, tag="t")
    states = flat_param_states(engine)
    names = engine.optimizer.param_names
    opt = engine.optimizer
    masters = {}
    for i, params in enumerate(opt.round_robin_bit16_groups):  # the fp32 master weights, per parameter
        flat = opt.single_partition_of_fp32_groups[i]
        for seg in opt.bnb_layouts[i].segments(0, opt.bnb_eight_bit[i]):
            masters[names[params[seg.slot]]] = flat.narrow(0, seg.offset, seg.numel).clone()
    return folder, {names[p]: (s, p.numel()) for p, s in states.items()}, masters, engine


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_export_universal_loads_into_stock_adamw(saved, tmp_path, stage):
    folder, states, masters, original = saved
    out = str(tmp_path / "universal")
    assert main(["export", folder, out, "--universal", "--stock", "--quiet"]) == 0
    engine = torch_adamw_engine(stage, universal=True)
    engine.load_checkpoint(out)
    for name, param in engine.module.named_parameters():
        state, numel = states[name]
        moments = bnb_moments(state, numel)  # bitsandbytes' own dequantization of the saved state
        assert torch.equal(safe_get_full_fp32_param(param).reshape(-1), masters[name]), name
        for key, bnb_key in (("exp_avg", "state1"), ("exp_avg_sq", "state2")):
            got = safe_get_full_optimizer_state(param, key).reshape(-1)
            assert torch.equal(got, moments[bnb_key].reshape(-1)), (name, key)
    torch_state = next(iter(engine.optimizer.optimizer.state.values()))
    assert float(torch_state["step"]) == STEPS
    saved_lr = [g["lr"] for g in original.optimizer.param_groups]
    if stage == 3:  # DeepSpeed's ZeRO-3 universal loader gives every param group the hyper-parameters of the first
        saved_lr = saved_lr[:1] * len(saved_lr)
    assert [g["lr"] for g in engine.optimizer.param_groups] == saved_lr
    losses = train_steps(engine, range(STEPS, STEPS + 2))
    assert all(torch.isfinite(torch.tensor(losses)))


def ds_to_universal(tag_dir, out):
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
                           "--output_folder", out, "--inject_missing_state", "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True,
                          env={**without_launch_vars(), "DS_ACCELERATOR": "cpu"}, timeout=600)
    return done.returncode, done.stdout + done.stderr


def test_universal_from_deepspeed_converts_to_8bit(one_rank, tmp_path):
    stock = torch_adamw_engine(2, universal=False, lr=1e-3, seed=0)
    train_steps(stock, range(STEPS))
    stock.save_checkpoint(str(tmp_path / "torch"), tag="t")
    code, log = ds_to_universal(str(tmp_path / "torch" / "t"), str(tmp_path / "torch" / "t_universal"))
    assert code == 0, log[-3000:]
    # torch's moments and weights as DeepSpeed's converter wrote them (stock safe_get_full_optimizer_state cannot
    # say: DeepSpeed links the optimizer-state fragments right after stepping the first param group, before the
    # others have state, so every parameter outside the first group raises "exp_avg not found")
    torch_state = {name: {key: torch.load(tmp_path / "torch" / "t_universal" / "zero" / name / f"{key}.pt",
                                          weights_only=False)["param"].reshape(-1)
                          for key in ("exp_avg", "exp_avg_sq", "fp32")}
                   for name, _ in stock.module.named_parameters()}
    report = convert(str(tmp_path / "torch"), str(tmp_path / "eight"), "8bit", min_8bit_size=MIN_8BIT_SIZE,
                     progress=False)
    with pytest.raises(CheckpointMismatchError, match=r"holds the moments \['exp_avg', 'exp_avg_sq'\]; the target "
                                                      r"keeps \('exp_avg',\)"):  # Lion's state: exp_avg_sq dropped
        convert(str(tmp_path / "torch"), str(tmp_path / "lion"), "8bit", optimizer_class="bitsandbytes.optim.Lion8bit",
                min_8bit_size=MIN_8BIT_SIZE, progress=False)
    assert not (tmp_path / "lion").exists()
    worst = float(report.split("absolute, ")[1].split(" of one")[0])
    print(report)
    assert worst <= 0.5 + 1e-6, report
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, lr=5e-2, seed=1)
    engine.load_checkpoint(str(tmp_path / "eight"))
    names = engine.optimizer.param_names
    # and back to a stock universal checkpoint (stock -> 8-bit -> stock): the weights exact, the moments what the
    # 8-bit state dequantizes to, so within half a quantization step of torch's
    export(str(tmp_path / "eight"), str(tmp_path / "stock_again"), universal=True, stock=True, progress=False)
    again_dir = next((tmp_path / "stock_again").glob("*/zero"))  # under the tag convert wrote
    eight_bit = 0
    for p, state in flat_param_states(engine).items():
        reference = torch_state[names[p]]
        moments = bnb_moments(state, p.numel())
        again = {key: torch.load(again_dir / names[p] / f"{key}.pt", weights_only=True)["param"].reshape(-1)
                 for key in ("exp_avg", "exp_avg_sq", "fp32")}
        for key, torch_key in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
            expected = reference[torch_key]
            assert torch.equal(again[torch_key], moments[key].reshape(-1)), (names[p], key)
            if state[key].dtype == torch.uint8:
                eight_bit += 1
                gap = code_gap(expected, state[f"absmax{key[-1]}"], state[f"qmap{key[-1]}"])
                error = (moments[key].reshape(-1) - expected).abs()
                assert torch.all(error <= 0.5 * gap + ROUNDING * expected.abs()), (names[p], key)
            else:
                assert torch.equal(moments[key].reshape(-1), expected), (names[p], key)
        assert state["step"] == STEPS
        assert torch.equal(p.detach().reshape(-1), reference["fp32"]), names[p]
        assert torch.equal(again["fp32"], reference["fp32"]), names[p]
    assert eight_bit >= 4  # the 8-bit path was exercised
    train_steps(engine, range(STEPS, STEPS + 1))


@pytest.mark.parametrize("stage", [2, 3])
def test_an_engine_of_ours_loads_deepspeeds_universal_checkpoint_of_a_torch_run(one_rank, tmp_path, stage):
    """ds_to_universal's output of a stock ZeRO-2 torch AdamW run (its model states hold whole weights) loads into an
    AdamW8bit engine with `load_universal` at ZeRO-2 and ZeRO-3 (whose rewritten files must hold DeepSpeed's stage-3
    placeholders, not whole weights): the weights torch's fp32 weights exactly, and it trains on."""
    from support.toy import gathered_weights
    stock = torch_adamw_engine(2, universal=False, lr=1e-3, seed=0)
    train_steps(stock, range(STEPS))
    stock.save_checkpoint(str(tmp_path / "torch"), tag="t")
    fp32 = {name: safe_get_full_fp32_param(p).clone() for name, p in stock.module.named_parameters()}
    code, log = ds_to_universal(str(tmp_path / "torch" / "t"), str(tmp_path / "torch" / "t_universal"))
    assert code == 0, log[-3000:]
    model = make_model(1)
    optimizer = bnb.optim.AdamW8bit(param_groups(model, lr=5e-2), min_8bit_size=MIN_8BIT_SIZE)
    config = {**ds_config(1, stage=stage), "checkpoint": {"load_universal": True}}
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    engine.load_checkpoint(str(tmp_path / "torch"), tag="t_universal")
    for name, weights in gathered_weights(engine).items():
        assert torch.equal(weights, fp32[name]), name
    train_steps(engine, range(STEPS, STEPS + 1))


@pytest.mark.parametrize("dp, stage", [(None, None), (3, 3)])  # the files of one rank, or of 3 ZeRO-3 ranks
def test_round_trip_through_universal_is_within_half_a_step(saved, tmp_path, dp, stage):
    folder, states, masters, original = saved
    export(folder, str(tmp_path / "universal"), universal=True, stock=True, progress=False)
    convert(str(tmp_path / "universal"), str(tmp_path / "back"), "8bit", min_8bit_size=MIN_8BIT_SIZE, progress=False,
            dp=dp, stage=stage)
    written = [n for n in os.listdir(tmp_path / "back" / "t") if "optim_states" in n]
    assert len(written) == (dp or 1)
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, lr=5e-2, seed=1)
    engine.load_checkpoint(str(tmp_path / "back"))
    names = engine.optimizer.param_names
    for p, state in flat_param_states(engine).items():
        saved_state, numel = states[names[p]]
        before, after = bnb_moments(saved_state, numel), bnb_moments(state, numel)
        for key in ("state1", "state2"):
            if saved_state[key].dtype != torch.uint8:  # fp32 state: exact
                assert torch.equal(after[key], before[key]), (names[p], key)
                continue
            # 8-bit: the block's absmax is recomputed from the dequantized values, each value requantized to its
            # nearest code: within half a quantization step of what was saved
            value = before[key].reshape(-1)
            gap = code_gap(value, state[f"absmax{key[-1]}"], state[f"qmap{key[-1]}"])
            error = (after[key].reshape(-1) - value).abs()
            assert torch.all(error <= 0.5 * gap + ROUNDING * value.abs()), (names[p], key)
        assert state["step"] == saved_state["step"]
        assert torch.equal(p.detach().reshape(-1).float(), masters[names[p]])


def test_deepspeeds_converter_cannot_read_bnb_state_control(saved, tmp_path):
    folder, *_ = saved
    code, log = ds_to_universal(os.path.join(folder, "t"), str(tmp_path / "u"))
    assert code != 0 and "KeyError" in log, log[-2000:]
