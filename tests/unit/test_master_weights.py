"""bf16 and compensated ("bf16+8") master weights for bnb optimizers, on one CPU rank.

- ops/compensated.py against fp32 arithmetic: split rounds to nearest-even bf16 (the model's weight) and keeps the
  rounding error to one 1/256-ulp step; split(join(...)) is exact, zeros keep their sign, non-finite weights pass.
  Control: repeated updates far below half a bf16 ulp vanish from plain bf16 weights and not from compensated ones.
- "bf16" (DeepSpeed's bf16_master_weights_and_grads, or bnb_master_weights) equals plain bitsandbytes stepping the
  bf16 model itself, bit for bit, at ZeRO-1 and 2, with and without CPU offload.
- "bf16+8" equals plain bitsandbytes stepping fp32 copies of the weights that are split and joined after every step
  (the definition, applied outside DeepSpeed), bit for bit; over a longer low-lr run it stays near the fp32-master run
  where "bf16" drifts away (control).
- Checkpoints: the record names the mode; compensated weights are saved as the exact fp32 values they stand for
  (what export and zero_to_fp32 read); every mode loads into every other, exactly where the bits allow, with a warning
  where it rounds; `inspect` shows the mode.
- Refusals name the key: "fp32" against DeepSpeed's key, bf16 modes on an fp32 model, an unknown mode.
- The fused kernel steps both modes (bnb_fused_kernel "auto" on the CPU) and ends where bnb's own update ends, within
  the weights' rounding; the comparisons with plain bnb above run bnb's own update (bnb_fused_kernel: false).
"""

import logging

import bitsandbytes as bnb
import deepspeed
import pytest
import torch
from safetensors.torch import load_file

import deepspeed_bnb  # noqa: F401
from deepspeed_bnb.checkpoint.format.constants import BASE_OPTIMIZER_STATE_KEY, MASTER_MODE_KEY, MASTER_WEIGHTS_KEY
from deepspeed_bnb.checkpoint.tools.export import export
from deepspeed_bnb.checkpoint.tools.summary import summary
from deepspeed_bnb.ops import compensated
from deepspeed_bnb.optim import master_weights
from support.kernel_harness import needs_kernel
from support.toy import (MIN_8BIT_SIZE, ds_config, global_batch, loss_fn, make_model, param_groups, train_plain,
                         train_steps)

STEPS = 3


def engine_of(mode="auto", stage=2, lr=1e-3, seed=0, offload=False, bf16_master=False, **zero):
    model = make_model(seed, dtype=torch.bfloat16)
    optimizer = bnb.optim.AdamW8bit(param_groups(model, lr=lr), min_8bit_size=MIN_8BIT_SIZE)
    config = ds_config(1, stage=stage, bf16=True, offload=offload, bf16_master=bf16_master, bnb_master_weights=mode,
                       **zero)
    return model, deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def masters(engine) -> list:
    """The engine's master weights per partition as the fp32 values they stand for (stages 1/2)."""
    opt = engine.optimizer
    return [compensated.join(p, e) if e is not None else p.float()
            for p, e in zip(opt.single_partition_of_fp32_groups, opt.bnb_master_errors)]


# ---- the compensation itself ----------------------------------------------------------------------------------------

def _weights(n=200_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * torch.logspace(-6, 2, n)
    w[:8] = torch.tensor([0.0, -0.0, 1.0, -2.0 ** -126, 1e-40, 3.0e38, float("inf"), float("nan")])
    return w


_split = compensated.split


def test_split_rounds_to_the_model_weight_and_keeps_the_error_to_one_step():
    w = _weights()
    hi, lo = _split(w)
    nan = w.isnan()
    assert torch.equal(hi.view(torch.int16)[~nan], w.to(torch.bfloat16).view(torch.int16)[~nan])  # bf16's rounding
    assert (hi.view(torch.int16)[nan] == 0x7FC0).all() and nan.any()  # the quiet NaN the fused kernels store
    back = compensated.join(hi, lo)
    finite = torch.isfinite(w) & (w.abs() > 2.0 ** -126)  # normal numbers
    _, exponent = torch.frexp(hi.float())
    step = torch.ldexp(torch.ones_like(w), exponent - 16)  # 1/256 of bf16's ulp
    assert ((back - w).abs() <= step)[finite].all()
    assert ((back - w).abs() <= step / 2)[finite].float().mean() > 0.99  # one step only where clamped at a tie
    relative = ((back - w).abs() / w.abs())[finite]
    assert relative.max() <= 2.0 ** -15  # 16 significant bits
    assert ((hi.float() - w).abs() / w.abs())[finite].max() > 2.0 ** -10  # control: bf16 alone keeps 8


def test_join_then_split_is_exact_and_keeps_signs():
    hi, lo = _split(_weights())
    hi2, lo2 = _split(compensated.join(hi, lo))
    assert torch.equal(hi2.view(torch.int16), hi.view(torch.int16)) and torch.equal(lo2, lo)
    assert torch.signbit(compensated.join(hi, lo)[1])  # -0.0 stays negative
    assert lo[6] == 0 and lo[7] == 0  # inf and nan: no error term


def test_small_updates_survive_compensation_and_vanish_in_bf16():
    """A weight of 0.4 gets 1000 updates of 1e-4 each: 1/10 of half its bf16 ulp, 13.1 steps of its error term,
    which each update is rounded to (13: 0.8% less, the bias of rounding every update to a whole step)."""
    fp32 = torch.full((256,), 0.4)
    plain = fp32.to(torch.bfloat16)
    hi, lo = _split(fp32)
    for _ in range(1000):
        fp32 += 1e-4
        plain += 1e-4
        compensated.split_(compensated.join(hi, lo) + 1e-4, hi, lo)
    assert torch.equal(plain, torch.full((256,), 0.4, dtype=torch.bfloat16))  # control: nothing moved
    moved = compensated.join(hi, lo) - 0.4
    assert ((moved - (fp32 - 0.4)).abs() < 0.01 * (fp32 - 0.4)).all()  # within 1% of the 0.1 it moved


# ---- configuration --------------------------------------------------------------------------------------------------

def test_modes_resolve_from_both_keys():
    bf16 = torch.bfloat16
    assert master_weights.resolve("auto", False, {bf16}).mode == "fp32"
    assert master_weights.resolve("auto", True, {bf16}).mode == "bf16"
    assert master_weights.resolve("bf16+8", True, {bf16}).compensated
    assert master_weights.resolve("bf16", False, {bf16}).dtype == bf16
    with pytest.raises(ValueError, match=r"bnb_master_weights: \"fp32\" contradicts bf16.bf16_master_weights_and_gr"):
        master_weights.resolve("fp32", True, {bf16})
    with pytest.raises(ValueError, match=r"'bf16\+8' keeps bf16 master weights, which needs bf16 trainable weights"):
        master_weights.resolve("bf16+8", False, {torch.float32})


def test_unknown_mode_is_refused_by_the_config(one_rank):
    model = make_model(0, dtype=torch.bfloat16)
    with pytest.raises(Exception, match=r"bnb_master_weights must be one of 'auto', 'fp32', 'bf16', 'bf16\+8'"):
        deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(model.parameters()),
                             config=ds_config(1, bf16=True, bnb_master_weights="bf16+16"))


@needs_kernel
@pytest.mark.parametrize("mode", ["bf16", "bf16+8"])
def test_fused_kernel_steps_bf16_and_compensated_master_weights_as_bnb_does(one_rank, mode):
    """"auto" steps every parameter with the fused kernel (bf16 or compensated weights read and written in its
    pass): after STEPS steps its weights are where bnb's own update (bnb_fused_kernel: false) takes them, to within 5%
    of the distance they moved (kernel and bnb differ in fp32 arithmetic and quantizer ties on 8-bit state, each step
    one rounding at most: tests/kernels/test_fused_rules.py), and after the first step exactly there for the
    32-bit-state parameters (the kernel computes bnb's own 32-bit CPU update: ops/rules.py, bnb_cpu; later steps see
    the gradients of the 8-bit parameters' weights). Control: the other master mode is not."""
    model, fused = engine_of(mode)
    assert all(r.fused for r in fused.optimizer.bnb_routes.values()), fused.optimizer.bnb_routes
    _, plain = engine_of(mode, bnb_fused_kernel=False)
    assert not any(r.fused for r in plain.optimizer.bnb_routes.values())
    start = torch.cat(masters(engine_of(mode)[1]))
    train_steps(fused, range(1))
    train_steps(plain, range(1))
    # after one step (later steps see gradients of the 8-bit parameters' differing weights)
    exact = [(m.narrow(0, s.offset, s.numel), t.narrow(0, s.offset, s.numel))
             for m, t, segments in zip(masters(fused), masters(plain), fused.optimizer.bnb_segments)
             for s in segments if not s.eight_bit]
    assert exact and all(torch.equal(m, t) for m, t in exact), "32-bit state: bnb's own bits"
    train_steps(fused, range(1, STEPS))
    train_steps(plain, range(1, STEPS))
    mine, theirs = torch.cat(masters(fused)), torch.cat(masters(plain))
    assert float((mine - theirs).norm() / (theirs - start).norm()) < 0.05  # measured: 0.012 (bf16), 0.011 (bf16+8)
    # control: the other mode's fused run, held to the same bar, fails it (measured: 0.31 and 0.30)
    other = engine_of("bf16+8" if mode == "bf16" else "bf16")[1]
    train_steps(other, range(STEPS))
    assert float((torch.cat(masters(other)) - theirs).norm() / (theirs - start).norm()) > 0.05
    if mode == "bf16+8":
        assert any((e != 0).any() for e in fused.optimizer.bnb_master_errors), "the kernel writes error terms"


def test_bf16_optimizer_states_is_ignored_with_a_warning(one_rank, caplog):
    model = make_model(0, dtype=torch.bfloat16)
    config = ds_config(1, bf16=True)
    config["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)),
                                      config=config)[0]
    finally:
        logger.removeHandler(caplog.handler)
    assert engine.optimizer.bnb_master.mode == "bf16"
    assert "bf16.bf16_optimizer_states is ignored for AdamW8bit: its state is 8-bit" in caplog.text
    assert engine.optimizer.optimizer.state[engine.optimizer.single_partition_of_fp32_groups[0]]["state1"].dtype \
        == torch.uint8


# ---- training -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage, offload, ds_key", [(1, False, True), (2, False, False), (2, True, False)],
                         ids=["stage1-deepspeed-key", "stage2", "stage2-offload"])
def test_bf16_master_weights_equal_bnb_stepping_the_bf16_model(one_rank, stage, offload, ds_key):
    model, engine = engine_of("auto" if ds_key else "bf16", stage=stage, offload=offload, bf16_master=ds_key,
                              bnb_fused_kernel=False)
    assert engine.optimizer.single_partition_of_fp32_groups[0].dtype == torch.bfloat16
    reference = make_model(0, dtype=torch.bfloat16)
    plain = bnb.optim.AdamW8bit(param_groups(reference), min_8bit_size=MIN_8BIT_SIZE)
    train_steps(engine, range(STEPS))
    train_plain(reference, plain, range(STEPS))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(next(model.parameters()), make_model(0, dtype=torch.bfloat16).emb.weight)  # it moved


def _compensated_plain_bnb(steps):
    """The reference for "bf16+8": plain bnb stepping fp32 copies of the bf16 model's weights, each copy split into
    bf16 and error term and joined again after every step, the model taking the bf16 part."""
    model = make_model(0, dtype=torch.bfloat16)
    params = list(model.parameters())
    wide = {p: p.detach().float().requires_grad_(True) for p in params}
    groups = [{**g, "params": [wide[p] for p in g["params"]]} for g in param_groups(model)]
    optimizer = bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE)
    for step in steps:
        tokens, targets = global_batch(step)
        loss_fn(model, tokens, targets).backward()
        for p in params:
            wide[p].grad, p.grad = p.grad.float(), None
        optimizer.step()
        with torch.no_grad():
            for p in params:
                hi, lo = _split(wide[p])
                wide[p].copy_(compensated.join(hi, lo))
                p.copy_(hi)
    return model, wide


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offload"])
def test_compensated_master_weights_equal_their_definition_applied_to_bnb(one_rank, offload):
    model, engine = engine_of("bf16+8", offload=offload, bnb_fused_kernel=False)
    reference, wide = _compensated_plain_bnb(range(STEPS))
    train_steps(engine, range(STEPS))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    assert any((e != 0).any() for e in engine.optimizer.bnb_master_errors)  # the error terms are in use
    theirs = {p: wide[q] for p, q in zip(model.parameters(), reference.parameters())}
    values = masters(engine)
    for g, group in enumerate(engine.optimizer.bnb_params):  # and hold the reference's fp32 weights exactly
        for slot, p in zip(engine.optimizer.bnb_layouts[g].slots, group):
            assert torch.equal(values[g].narrow(0, slot.offset, p.numel()), theirs[p].reshape(-1))


def test_compensated_tracks_fp32_master_weights_where_bf16_drifts(one_rank):
    """40 steps at lr 1e-4: the weights of each mode against the fp32-master run's (all with 8-bit state)."""
    steps, lr = range(40), 1e-4
    runs = {}
    for mode in ("fp32", "bf16", "bf16+8"):
        _, engine = engine_of(mode, lr=lr)
        train_steps(engine, steps)
        runs[mode] = torch.cat(masters(engine))
    start = torch.cat(masters(engine_of("fp32")[1]))  # the same layout, untrained
    moved = (runs["fp32"] - start).norm()
    off = {mode: (runs[mode] - runs["fp32"]).norm() / moved for mode in ("bf16", "bf16+8")}
    assert off["bf16+8"] < 0.05 < 0.25 < off["bf16"], off  # measured: 0.018 and 0.86


# ---- checkpoints --------------------------------------------------------------------------------------------------

def _saved(engine, tmp_path, tag="t"):
    engine.save_checkpoint(str(tmp_path), tag=tag)
    blob = torch.load(tmp_path / tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    return blob["optimizer_state_dict"]


def test_compensated_checkpoint_holds_the_values_and_loads_into_every_mode(one_rank, tmp_path, caplog):
    _, engine = engine_of("bf16+8")
    train_steps(engine, range(STEPS))
    state = _saved(engine, tmp_path)
    values = masters(engine)
    assert state[BASE_OPTIMIZER_STATE_KEY][MASTER_MODE_KEY] == "bf16+8"
    for saved, value, partition in zip(state[MASTER_WEIGHTS_KEY], values,
                                       engine.optimizer.single_partition_of_fp32_groups):
        assert saved.dtype == torch.float32 and torch.equal(saved, value.narrow(0, 0, saved.numel()))
        assert not torch.equal(saved, partition.narrow(0, 0, saved.numel()).float())  # control: more than bf16
    assert "master      bf16+8: bf16 master weights with an 8-bit error term" in summary(str(tmp_path / "t"))
    exported = load_file(export(str(tmp_path / "t"), str(tmp_path / "export"), progress=False)["model"])
    for g, group in enumerate(engine.optimizer.bnb_params):
        for slot, p in zip(engine.optimizer.bnb_layouts[g].slots, group):
            name = engine.optimizer.param_names[p]
            assert torch.equal(exported[name].reshape(-1), values[g].narrow(0, slot.offset, p.numel())), name

    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        for mode in ("bf16+8", "fp32", "bf16"):
            caplog.clear()
            _, loaded = engine_of(mode, seed=1)
            loaded.load_checkpoint(str(tmp_path), tag="t")
            got = masters(loaded)
            for mine, theirs in zip(got, values):
                want = theirs.to(torch.bfloat16).float() if mode == "bf16" else theirs  # bf16 keeps the rounded part
                assert torch.equal(mine, want), mode
            rounded = "they were rounded to bf16 on load" in caplog.text
            assert rounded == (mode == "bf16"), (mode, caplog.text)
    finally:
        logger.removeHandler(caplog.handler)


def test_bf16_checkpoint_is_bf16_and_fp32_loads_into_compensated(one_rank, tmp_path):
    _, bf16 = engine_of("bf16")
    train_steps(bf16, range(STEPS))
    state = _saved(bf16, tmp_path / "bf16")
    assert state[BASE_OPTIMIZER_STATE_KEY][MASTER_MODE_KEY] == "bf16"
    assert all(t.dtype == torch.bfloat16 for t in state[MASTER_WEIGHTS_KEY])  # 2 bytes per weight on disk too
    _, widened = engine_of("fp32", seed=1)
    widened.load_checkpoint(str(tmp_path / "bf16"), tag="t")
    assert all(torch.equal(a, b) for a, b in zip(masters(widened), masters(bf16)))  # exact

    _, fp32 = engine_of("fp32")
    train_steps(fp32, range(STEPS))
    fp32.save_checkpoint(str(tmp_path / "fp32"), tag="t")
    _, narrowed = engine_of("bf16+8", seed=1)
    narrowed.load_checkpoint(str(tmp_path / "fp32"), tag="t")
    for mine, theirs in zip(masters(narrowed), masters(fp32)):
        hi, lo = _split(theirs)
        assert torch.equal(mine, compensated.join(hi, lo))
        assert 0 < (mine - theirs).abs().max() <= theirs.abs().max() * 2.0 ** -15  # 24 bits of the 32 kept


@pytest.mark.parametrize("source, target", [("fp32", "bf16"), ("fp32", "bf16+8"), ("bf16", "fp32"),
                                            ("bf16+8", "fp32"), ("bf16", "bf16+8")])
def test_convert_switches_the_master_weights_offline(one_rank, tmp_path, source, target, caplog):
    """`deepspeed-bnb convert --master-weights` writes the checkpoint for another mode: the record and `inspect` name
    it, an engine of that mode loads it without rounding anything (no warning), its weights are the source's as the
    target holds them (torch's bf16 rounding; the compensated split), exactly where the target holds them all, and
    the optimizer state is the source's, bit for bit. Control: the weights differ from the source's exactly where
    the target cannot hold them."""
    from deepspeed_bnb import cli
    _, engine = engine_of(source)
    train_steps(engine, range(STEPS))
    engine.save_checkpoint(str(tmp_path / "in"), tag="t")
    out = tmp_path / "out"
    assert cli.main(["convert", str(tmp_path / "in" / "t"), str(out), "--master-weights", target, "--quiet"]) == 0
    assert f"master      {target}" in summary(str(out / "t")), summary(str(out / "t"))
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(caplog.handler)
    try:
        _, loaded = engine_of(target, seed=1)
        loaded.load_checkpoint(str(out), tag="t")
    finally:
        logger.removeHandler(caplog.handler)
    assert "rounded" not in caplog.text, caplog.text
    for mine, theirs in zip(masters(loaded), masters(engine)):
        want = (theirs.to(torch.bfloat16).float() if target == "bf16" else
                compensated.join(*_split(theirs)) if target == "bf16+8" else theirs)
        assert torch.equal(mine, want)
        lossless = source == "bf16" or target == "fp32"
        assert torch.equal(mine, theirs) == lossless, (source, target)
    for p, q in zip(loaded.optimizer.single_partition_of_fp32_groups, engine.optimizer.single_partition_of_fp32_groups):
        theirs, mine = engine.optimizer.optimizer.state[q], loaded.optimizer.optimizer.state[p]
        assert all(torch.equal(mine[k], v) if torch.is_tensor(v) else mine[k] == v for k, v in theirs.items())


def test_convert_master_weights_report_and_refusal(one_rank, tmp_path, capsys):
    _, engine = engine_of("fp32")
    train_steps(engine, range(STEPS))
    engine.save_checkpoint(str(tmp_path / "in"), tag="t")
    from deepspeed_bnb import cli
    assert cli.main(["convert", str(tmp_path / "in" / "t"), str(tmp_path / "a"), "--master-weights", "bf16",
                     "--quiet"]) == 0
    assert "master weights fp32 -> bf16; " in capsys.readouterr().out
    assert cli.main(["convert", str(tmp_path / "a" / "t"), str(tmp_path / "b"), "--master-weights", "fp32",
                     "--quiet"]) == 0
    assert "0 of " in capsys.readouterr().out  # bf16 -> fp32 rounds nothing
    assert cli.main(["convert", str(tmp_path / "in" / "t"), str(tmp_path / "c"), "--master-weights", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "convert --master-weights must be one of 'fp32', 'bf16', 'bf16+8'; got 'fp16'" in err, err
    assert not (tmp_path / "c").exists()


def test_refresh_from_the_model_clears_the_error_terms(one_rank):
    model, engine = engine_of("bf16+8")
    train_steps(engine, range(STEPS))
    assert any((e != 0).any() for e in engine.optimizer.bnb_master_errors)
    engine.optimizer.refresh_fp32_params()
    assert all(not (e != 0).any() for e in engine.optimizer.bnb_master_errors)
    values = masters(engine)
    for g, group in enumerate(engine.optimizer.bnb_params):  # the master weights are the model's, exactly
        for slot, p in zip(engine.optimizer.bnb_layouts[g].slots, group):
            assert torch.equal(values[g].narrow(0, slot.offset, p.numel()), p.detach().reshape(-1).float())


@pytest.mark.parametrize("stage", [2, 3])
def test_weight_api_gives_and_takes_the_values_compensated_weights_stand_for(one_rank, stage):
    """DeepSpeed's safe_{get,set}_full_fp32_param: fp32, the bf16 weights joined with their error terms; a set is
    split into both (a value with 16 significant bits comes back exactly). Control: the bf16 part alone differs."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
    model, engine = engine_of("bf16+8", stage=stage)
    train_steps(engine, range(STEPS))
    name, param = "fc1.weight", dict(model.named_parameters())["fc1.weight"]
    full = safe_get_full_fp32_param(param)
    assert full.dtype == torch.float32 and full.shape == (301, 40)
    if stage == 2:
        slot = next(s for s, p in zip(engine.optimizer.bnb_layouts[0].slots, engine.optimizer.bnb_params[0])
                    if p is param)
        assert torch.equal(full.reshape(-1), masters(engine)[0].narrow(0, slot.offset, param.numel()))
    hi, lo = _split(full)
    assert (lo != 0).any() and not torch.equal(hi.float(), full)  # control: more than the bf16 part
    wanted = compensated.join(*_split(torch.randn(301, 40)))  # representable exactly
    safe_set_full_fp32_param(param, wanted)
    assert torch.equal(safe_get_full_fp32_param(param), wanted), name


def test_the_shipped_config_keeps_compensated_master_weights(one_rank):
    import json
    import os
    from conftest import TESTS
    with open(os.path.join(os.path.dirname(TESTS), "configs", "zero2_adamw8bit_bf16_compensated.json")) as f:
        config = json.load(f)
    config.pop("scheduler")
    config["train_micro_batch_size_per_gpu"] = 12
    model = make_model(0)
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)), config=config)[0]
    assert engine.optimizer.bnb_master.mode == "bf16+8" and engine.optimizer.bnb_master_errors[0] is not None
