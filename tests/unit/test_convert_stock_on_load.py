"""`zero_optimization.bnb_convert_stock_on_load`: an engine of deepspeed_bnb resumes a stock DeepSpeed run's
checkpoint, optimizer state included, at `load_checkpoint` (what a framework's `resume_from_checkpoint` calls).

References: the stock engine's own state at save (bnb's codes dequantized by bitsandbytes itself, or torch's moments)
and its next losses; the offline route (`convert`, then a load), which the key must equal bit for bit. Controls:
without the key the same load is refused naming it; a source convert cannot read is refused by name with nothing
left beside it; a weights-only load and a deepspeed_bnb tag do not convert at all.
"""

import functools
import hashlib
import os

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.tools.convert import convert
from support.bnb_state import assert_holds_moments, assert_same, engine_param_states, stock_moments
from support.toy import MIN_8BIT_SIZE, build_engine, gathered_weights, train_steps

KEY = {"bnb_convert_stock_on_load": True}


def digests(folder) -> dict:
    """Every file under `folder` -> its sha256 (the source must only be read)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def stock_8bit(one_rank, tmp_path_factory):
    """A stock ZeRO-2 run of bnb AdamW8bit (DeepSpeed's rigid save), its moments at save and its next losses."""
    folder = tmp_path_factory.mktemp("stock8")
    stock = build_engine(bnb.optim.AdamW8bit, stock=True, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(3))
    stock.save_checkpoint(str(folder), tag="global_step3")
    return str(folder), stock_moments(stock), gathered_weights(stock), train_steps(stock, range(3, 6))


def test_a_stock_bnb_run_resumes_with_its_moments_at_load(stock_8bit, tmp_path, capsys):
    folder, moments, weights, continued = stock_8bit
    before = digests(folder)
    with pytest.raises(CheckpointMismatchError, match="bnb_convert_stock_on_load: true"):  # control: the default
        build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)

    engine = build_engine(seed=1, lr=5e-2, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)  # lr comes from the checkpoint
    path, _ = engine.load_checkpoint(folder)  # the tag from `latest`, as HF Trainer's resume asks
    printed = capsys.readouterr().out
    assert "stock DeepSpeed checkpoint" in printed and "of one quantization step" in printed
    assert "from-stock" not in printed  # the scratch tag, gone when the load returns, is not named
    assert path == os.path.join(folder, "global_step3", "mp_rank_00_model_states.pt")  # the source's, not scratch
    assert digests(folder) == before  # the source was only read, and the scratch tag is gone
    assert engine.global_steps == 3 and [g["lr"] for g in engine.optimizer.param_groups] == [1e-3, 5e-4]
    states = engine_param_states(engine)
    assert states.keys() == moments.keys()
    assert sum(assert_holds_moments(states[name], moments[name], name) for name in states) > 0
    assert all(torch.equal(w, weights[n]) for n, w in gathered_weights(engine).items())

    convert(folder, str(tmp_path / "offline"), "8bit", min_8bit_size=MIN_8BIT_SIZE, progress=False)
    offline = build_engine(seed=2, min_8bit_size=MIN_8BIT_SIZE)
    offline.load_checkpoint(str(tmp_path / "offline"))
    for name, state in engine_param_states(offline).items():  # the key is the offline route, bit for bit
        assert_same(states[name], state, name)
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued)) < 1e-3


def test_hf_trainers_optimizer_gets_its_own_precision_per_parameter(stock_8bit):
    """HF Trainer's `adamw_bnb_8bit` builds bnb's AdamW with optim_bits=8 (not AdamW8bit) and keeps embeddings in
    32-bit state (a GlobalOptimManager override): the conversion at load gives each parameter the engine's own
    precision. The embedding's 32-bit moments are then the stock run's dequantized codes exactly; the others equal
    AdamW8bit's conversion. (Before, a fresh AdamW of that class kept 32-bit state, "keeps 32-bit state", and the
    embedding got 8-bit state by its size: "per-parameter state precision differs".)"""
    folder, moments, _, _ = stock_8bit
    engine = build_engine(bnb.optim.AdamW, seed=1, optim_bits=8, min_8bit_size=MIN_8BIT_SIZE, zero=KEY, emb32=True)
    engine.load_checkpoint(folder)
    states = engine_param_states(engine)
    assert states["emb.weight"]["state1"].dtype == torch.float32
    assert torch.equal(states["emb.weight"]["state1"].reshape(-1), moments["emb.weight"][0])
    assert torch.equal(states["emb.weight"]["state2"].reshape(-1), moments["emb.weight"][1])
    plain = build_engine(bnb.optim.AdamW8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    plain.load_checkpoint(folder)
    theirs = engine_param_states(plain)
    assert theirs["emb.weight"]["state1"].dtype == torch.uint8  # control: by its size the embedding is 8-bit
    for name, state in states.items():
        if name != "emb.weight":
            assert_same(state, theirs[name], name)


def test_offline_convert_takes_the_32bit_parameters_by_name(stock_8bit, tmp_path, capsys):
    """`deepspeed-bnb convert --32bit-params emb.weight`: the offline route for such an engine, the same state as the
    conversion at load; a name the checkpoint lacks is refused, naming it, nothing written. Control: converted by
    size alone, the engine refuses the result, naming --32bit-params."""
    from deepspeed_bnb.cli import main
    folder = stock_8bit[0]
    common = ["convert", folder, None, "--to", "8bit", "--optimizer-class", "bitsandbytes.optim.adamw.AdamW",
              "--min-8bit-size", str(MIN_8BIT_SIZE), "--quiet"]
    assert main([*common[:2], str(tmp_path / "typo"), *common[3:], "--32bit-params", "emb.wieght"]) == 2
    assert "['emb.wieght']" in capsys.readouterr().err and not (tmp_path / "typo").exists()
    assert main([*common[:2], str(tmp_path / "by_size"), *common[3:]]) == 0
    assert main([*common[:2], str(tmp_path / "named"), *common[3:], "--32bit-params", "emb.weight"]) == 0
    engines = {}
    for name in ("by_size", "named", "at_load"):
        engines[name] = build_engine(bnb.optim.AdamW, seed=1, optim_bits=8, min_8bit_size=MIN_8BIT_SIZE, emb32=True,
                                     zero=KEY if name == "at_load" else None)
    with pytest.raises(CheckpointMismatchError, match=r"emb.weight.*--32bit-params NAME"):
        engines["by_size"].load_checkpoint(str(tmp_path / "by_size"))
    engines["named"].load_checkpoint(str(tmp_path / "named"))
    engines["at_load"].load_checkpoint(folder)
    theirs = engine_param_states(engines["at_load"])
    for name, state in engine_param_states(engines["named"]).items():
        assert_same(state, theirs[name], name)


def test_a_stock_zero3_run_of_torch_adamw_resumes_in_a_32bit_bnb_engine(one_rank, tmp_path):
    """A stock ZeRO-3 run of torch's AdamW into a ZeRO-2 engine of bnb's 32-bit AdamW: torch's moments exactly."""
    stock = build_engine(torch.optim.AdamW, stock=True, stage=3)
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "s3"))
    expected = stock_moments(stock)
    engine = build_engine(bnb.optim.AdamW, seed=1, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "s3"))
    for name, state in engine_param_states(engine).items():
        assert torch.equal(state["state1"].reshape(-1), expected[name][0]), name
        assert torch.equal(state["state2"].reshape(-1), expected[name][1]), name


def test_an_elastic_stock_checkpoint_takes_the_engines_hyperparameters(one_rank, tmp_path):
    """DeepSpeed's elastic save keeps no param group hyper-parameters and its own elastic load keeps the loading
    engine's: so does the conversion at load (offline, convert asks for them)."""
    stock = build_engine(torch.optim.AdamW, stock=True, stage=1, zero={"elastic_checkpoint": True})
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "elastic"), tag="e")
    expected = {name: moments[0] for name, moments in stock_moments(stock).items()}
    engine = build_engine(bnb.optim.AdamW, seed=1, lr=5e-2, stage=1, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "elastic"))
    assert [g["lr"] for g in engine.optimizer.param_groups] == [5e-2, 2.5e-2]  # the engine's (support.toy halves)
    for name, state in engine_param_states(engine).items():
        assert torch.equal(state["state1"].reshape(-1), expected[name]), name


# bnb class -> its arguments here (SGD8bit has no default lr: the groups' own replace it) and torch's name of its state
ONE_STATE = {"Lion8bit": ({}, ("exp_avg",)), "SGD8bit": ({"lr": 1e-3, "momentum": 0.9}, ("momentum_buffer",)),
             "RMSprop8bit": ({"alpha": 0.9}, ("square_avg",)), "Adagrad8bit": ({}, ("sum",))}


@pytest.fixture(scope="module", params=sorted(ONE_STATE))
def stock_one_state(one_rank, tmp_path_factory, request):
    """A stock ZeRO-2 run of a bnb optimizer with one state (Lion8bit, SGD8bit, RMSprop8bit, Adagrad8bit), as
    stock_8bit."""
    kwargs, names = ONE_STATE[request.param]
    cls = functools.partial(getattr(bnb.optim, request.param), **kwargs)
    cls.__name__ = request.param
    folder = tmp_path_factory.mktemp(request.param)
    stock = build_engine(cls, stock=True, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(3))
    stock.save_checkpoint(str(folder), tag="global_step3")
    return cls, str(folder), stock_moments(stock, names), gathered_weights(stock), \
        train_steps(stock, range(3, 6))


def test_a_stock_run_of_a_one_state_bnb_optimizer_resumes_with_its_state(stock_one_state, tmp_path):
    """bnb's files do not say which rule wrote state1: the engine's own class is the rule, as a stock load of the same
    files would take it. Its state within one code step of the stock run's (bnb dequantizing its own codes), bit for
    bit the offline convert with that class, the next 3 losses within 1e-3 of the stock run's. Control: the weights
    alone with fresh state miss that bound."""
    cls, folder, moments, weights, continued = stock_one_state
    before = digests(folder)
    engine = build_engine(cls, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    engine.load_checkpoint(folder)
    assert digests(folder) == before and engine.global_steps == 3
    states = engine_param_states(engine)
    assert states.keys() == moments.keys() and all("state2" not in state for state in states.values())
    assert sum(assert_holds_moments(states[name], moments[name], name) for name in states) > 0
    assert all(torch.equal(w, weights[n]) for n, w in gathered_weights(engine).items())
    convert(folder, str(tmp_path / "offline"), "8bit", optimizer_class=f"bitsandbytes.optim.{cls.__name__}",
            min_8bit_size=MIN_8BIT_SIZE, progress=False)
    offline = build_engine(cls, seed=2, min_8bit_size=MIN_8BIT_SIZE)
    offline.load_checkpoint(str(tmp_path / "offline"))
    for name, state in engine_param_states(offline).items():
        assert_same(states[name], state, name)
    resumed = max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued))
    fresh = build_engine(cls, seed=1, min_8bit_size=MIN_8BIT_SIZE)  # control: the weights, no state
    fresh.load_checkpoint(folder, load_optimizer_states=False)
    without = max(abs(a - b) for a, b in zip(train_steps(fresh, range(3, 6)), continued))
    print(f"{cls.__name__}: next 3 losses within {resumed:.2e} of the stock run's; the weights alone {without:.2e}")
    assert resumed < 1e-3 < without


def test_another_rules_count_of_states_is_refused_by_name_and_nothing_is_left(stock_one_state):
    """A one-state stock run into an Adam engine is refused, naming the count and the class to give; the source
    unchanged, nothing beside it; the weights load."""
    cls, folder, _, weights, _ = stock_one_state
    before = digests(folder)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    with pytest.raises(CheckpointMismatchError, match=r"bnb_convert_stock_on_load failed: .*one state \(Lion, "
                                                      r"SGD.*--optimizer-class"):
        engine.load_checkpoint(folder)
    assert digests(folder) == before
    engine.load_checkpoint(folder, load_optimizer_states=False)  # the weights need no conversion
    assert all(torch.equal(w, weights[n]) for n, w in gathered_weights(engine).items())


def test_a_stock_zero3_run_of_torch_sgd_resumes_in_a_bnb_sgd8bit_engine(one_rank, tmp_path):
    """torch's SGD keeps `momentum_buffer`, bnb's SGD8bit that momentum as state1 (its group packs momentum and
    dampening as betas): a stock ZeRO-3 run's momentum within one code step, its momentum setting carried over.
    Controls: torch's momentum into a Lion class (its state is exp_avg) is refused, naming the rule to give; a run of
    torch's Nesterov SGD, a rule bnb's SGD does not step (it ignores nesterov), is refused, nothing written."""
    stock = build_engine(torch.optim.SGD, stock=True, stage=3, momentum=0.8)
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "s3"))
    expected = stock_moments(stock, ("momentum_buffer",))
    sgd8 = functools.partial(bnb.optim.SGD8bit, lr=1e-3, momentum=0.9)
    engine = build_engine(sgd8, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "s3"))
    assert [g["betas"] for g in engine.optimizer.param_groups] == [(0.8, 0.0), (0.8, 0.0)]  # the run's, not 0.9
    states = engine_param_states(engine)
    assert states.keys() == expected.keys()
    assert sum(assert_holds_moments(states[name], expected[name], name) for name in states) > 0
    lion = build_engine(bnb.optim.Lion8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    with pytest.raises(CheckpointMismatchError, match=r"\['momentum_buffer'\].*'lars' or 'momentum' update rule"):
        lion.load_checkpoint(str(tmp_path / "s3"))
    nesterov = build_engine(torch.optim.SGD, stock=True, stage=3, momentum=0.8, nesterov=True)
    train_steps(nesterov, range(1))
    nesterov.save_checkpoint(str(tmp_path / "nesterov"))
    with pytest.raises(ValueError, match=r"steps with \{'nesterov': 'Nesterov momentum'\}.*another rule"):
        convert(str(tmp_path / "nesterov"), str(tmp_path / "out"), "8bit", progress=False,
                optimizer_class="bitsandbytes.optim.SGD8bit")
    assert not (tmp_path / "out").exists()


def test_a_stock_zero3_run_of_lion8bit_resumes_in_a_zero2_engine(one_rank, tmp_path):
    """Stock ZeRO-3 keeps bnb's state per sub-group's flat tensor (format/stock_zero3.py): a Lion8bit run's momentum,
    read there and cut per parameter, within one code step in a ZeRO-2 Lion8bit engine; its next losses track the
    stock run's within 1e-3."""
    stock = build_engine(bnb.optim.Lion8bit, stock=True, stage=3, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(2))
    stock.save_checkpoint(str(tmp_path / "s3"))
    expected = stock_moments(stock, ("exp_avg",))
    continued = train_steps(stock, range(2, 4))
    engine = build_engine(bnb.optim.Lion8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "s3"))
    states = engine_param_states(engine)
    assert states.keys() == expected.keys()
    assert sum(assert_holds_moments(states[name], expected[name], name) for name in states) > 0
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(2, 4)), continued)) < 1e-3


def test_a_stock_ademamix_run_resumes_with_both_emas_and_is_not_misread_as_adams(one_rank, tmp_path):
    """bnb's AdEMAMix8bit keeps its fast and slow EMAs as two rows of state1 (each row's blocks from its own start)
    and its second moment as state2. Into an AdEMAMix8bit engine at load: every row within one code step of the stock
    run's, the next 3 losses within 1e-3 (the weights alone miss it). Into an AdamW class: the count of states is
    Adam's, but read as Adam's first moment the slow EMA would be dropped (and was, silently, before this check):
    refused naming the shapes, nothing written."""
    stock = build_engine(bnb.optim.AdEMAMix8bit, stock=True, min_8bit_size=MIN_8BIT_SIZE)
    train_steps(stock, range(3))
    stock.save_checkpoint(str(tmp_path / "ademamix"), tag="t")
    moments = stock_moments(stock)  # fast EMA, slow EMA (state1's rows), second moment (state2)
    continued = train_steps(stock, range(3, 6))
    engine = build_engine(bnb.optim.AdEMAMix8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "ademamix"))
    eight_bit = 0
    for name, state in engine_param_states(engine).items():
        fast, slow, second = moments[name]
        assert state["state1"].shape[0] == 2, name
        for row, expected in enumerate((fast, slow)):  # each row of state1 held as a one-state parameter's state
            row_state = {"state1": state["state1"][row]}
            if state["state1"].dtype == torch.uint8:
                row_state.update(absmax1=state["absmax1"][row], qmap1=state["qmap1"])
            eight_bit += assert_holds_moments(row_state, [expected], f"{name}[{row}]")
        assert_holds_moments({key.replace("2", "1"): value for key, value in state.items() if key.endswith("2")},
                             [second], name)
    assert eight_bit > 0
    resumed = max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued))
    fresh = build_engine(bnb.optim.AdEMAMix8bit, seed=1, min_8bit_size=MIN_8BIT_SIZE)
    fresh.load_checkpoint(str(tmp_path / "ademamix"), load_optimizer_states=False)
    without = max(abs(a - b) for a, b in zip(train_steps(fresh, range(3, 6)), continued))
    print(f"AdEMAMix8bit: next 3 losses within {resumed:.2e} of the stock run's; the weights alone {without:.2e}")
    assert resumed < 1e-3 < without
    with pytest.raises(CheckpointMismatchError, match=r"state of the shapes \{'state1': \(2, \d+\), 'state2'"):
        convert(str(tmp_path / "ademamix"), str(tmp_path / "out"), "8bit", min_8bit_size=MIN_8BIT_SIZE,
                progress=False)
    assert not (tmp_path / "out").exists()


def test_adams_two_moments_into_a_one_state_class_are_refused(stock_8bit, tmp_path):
    with pytest.raises(CheckpointMismatchError, match=r"two states \(Adam, AdamW, LAMB, AdEMAMix\).*AdamW8bit"):
        convert(stock_8bit[0], str(tmp_path / "out"), "8bit", optimizer_class="bitsandbytes.optim.Lion8bit",
                progress=False)
    assert not (tmp_path / "out").exists()


def test_a_conversion_that_cannot_write_names_the_offline_route(stock_8bit, monkeypatch):
    """No room or no write access beside the checkpoint (a read-only mount): the load is refused naming the scratch
    folder and the offline command with this engine's settings, and nothing is left (the source only read)."""
    import errno

    import deepspeed_bnb.runtime.converted_load as converted_load
    folder = stock_8bit[0]
    before = digests(folder)

    def read_only(source, scratch, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", scratch)

    monkeypatch.setattr(converted_load, "convert", read_only)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    with pytest.raises(CheckpointMismatchError, match=rf"Read-only file system.*rewritten once into .*from-stock.*"
                                                      rf"deepspeed-bnb convert .*global_step3 OUT --to 8bit "
                                                      rf"--min-8bit-size {MIN_8BIT_SIZE} --optimizer-class "
                                                      rf"bitsandbytes.optim.adamw.AdamW8bit"):
        engine.load_checkpoint(folder)
    assert digests(folder) == before


def _scratch_folder(parent, name, content):
    os.makedirs(os.path.join(parent, name))
    with open(os.path.join(parent, name, "file"), "w") as f:
        f.write(content)
    return os.path.join(parent, name)


def _from_stock(folder) -> list:
    return sorted(name for name in os.listdir(folder) if ".from-stock" in name)


def test_loads_of_one_checkpoint_at_once_keep_apart(stock_8bit, tmp_path, monkeypatch):
    """Jobs loading one stock checkpoint at once (a sweep started from one run): each converts into a scratch folder
    of its own, and removes beside the tag only the scratch folders no load holds. The running load is a folder
    locked through another open file (flock excludes it as it would another process). Controls: a folder nobody
    holds (a killed load's) and the fixed name earlier releases used are removed, and so is the running load's once
    its lock is dropped: the lock, not the name, keeps it."""
    import shutil

    import deepspeed_bnb.runtime.converted_load as converted_load
    from deepspeed_bnb.checkpoint.format.publish import try_flock
    folder = str(tmp_path / "stock")
    shutil.copytree(stock_8bit[0], folder)
    running = _scratch_folder(folder, ".global_step3.from-stock.00000000000000aa.deepspeed_bnb", "running")
    _scratch_folder(folder, ".global_step3.from-stock.00000000000000bb.deepspeed_bnb", "killed")
    _scratch_folder(folder, ".global_step3.from-stock.deepspeed_bnb", "an earlier release's")
    held = os.open(running, os.O_RDONLY | os.O_DIRECTORY)
    assert try_flock(held)
    seen = []

    def watching(source, scratch, *args, **kwargs):
        seen.append((scratch, _from_stock(folder)))
        return convert(source, scratch, *args, **kwargs)

    monkeypatch.setattr(converted_load, "convert", watching)
    try:
        engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
        engine.load_checkpoint(folder)
        (scratch, during), = seen
        scratch = os.path.dirname(scratch)  # the converted tag's directory inside the load's scratch folder
        assert os.path.dirname(scratch) == folder and os.path.basename(scratch) not in (
            os.path.basename(running), ".global_step3.from-stock.deepspeed_bnb")
        assert converted_load.scratch_pattern(".global_step3.from-stock").fullmatch(os.path.basename(scratch))
        assert during == sorted([os.path.basename(running), os.path.basename(scratch)])  # the leftovers swept
        assert _from_stock(folder) == [os.path.basename(running)]  # its own removed, the running one kept whole
        with open(os.path.join(running, "file")) as f:
            assert f.read() == "running"
        assert sum(assert_holds_moments(state, stock_8bit[1][name], name)
                   for name, state in engine_param_states(engine).items()) > 0
    finally:
        os.close(held)
    build_engine(seed=2, min_8bit_size=MIN_8BIT_SIZE, zero=KEY).load_checkpoint(folder)  # control: unheld now
    assert _from_stock(folder) == []


def test_where_nothing_can_be_locked_leftovers_are_kept_and_named(stock_8bit, tmp_path, monkeypatch):
    """A file system without flock (some network ones): a leftover may belong to a load running now, so it is kept,
    and a warning names it; the load itself still converts, loads and removes its own folder."""
    import shutil

    import deepspeed_bnb.runtime.converted_load as converted_load
    folder = str(tmp_path / "stock")
    shutil.copytree(stock_8bit[0], folder)
    leftover = _scratch_folder(folder, ".global_step3.from-stock.00000000000000cc.deepspeed_bnb", "unknown")
    monkeypatch.setattr(converted_load, "try_flock", lambda fd: None)
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    with pytest.warns(RuntimeWarning, match=rf"{leftover}: scratch folders .* cannot lock, so they are kept"):
        engine.load_checkpoint(folder)
    assert _from_stock(folder) == [os.path.basename(leftover)] and engine.global_steps == 3


def test_a_leftover_another_load_removes_first_is_skipped(tmp_path, monkeypatch):
    """Two loads sweeping at once: a leftover one of them lists, and the other removes before it is opened, is passed
    over (the load goes on) rather than failing it. Control: a leftover still there is removed."""
    import deepspeed_bnb.runtime.converted_load as converted_load
    gone = str(tmp_path / ".t.from-stock.00000000000000dd.deepspeed_bnb")
    left = _scratch_folder(str(tmp_path), ".t.from-stock.00000000000000ee.deepspeed_bnb", "killed")
    is_dir = os.path.isdir
    monkeypatch.setattr(converted_load.os, "listdir", lambda folder: [os.path.basename(gone), os.path.basename(left)])
    monkeypatch.setattr(converted_load.os.path, "isdir", lambda path: path == gone or is_dir(path))
    converted_load._sweep_leftovers(str(tmp_path), ".t.from-stock")
    assert not os.path.lexists(left) and not os.path.lexists(gone)


def test_a_deepspeed_bnb_tag_is_not_converted(one_rank, tmp_path, monkeypatch):
    """With the key set, a tag deepspeed_bnb wrote loads as it is, bit for bit (the conversion would requantize)."""
    import deepspeed_bnb.runtime.converted_load as converted_load
    saving = build_engine(min_8bit_size=MIN_8BIT_SIZE)
    train_steps(saving, range(2))
    saving.save_checkpoint(str(tmp_path / "ours"))
    monkeypatch.setattr(converted_load, "convert", lambda *a, **k: pytest.fail("a deepspeed_bnb tag was converted"))
    engine = build_engine(seed=1, min_8bit_size=MIN_8BIT_SIZE, zero=KEY)
    engine.load_checkpoint(str(tmp_path / "ours"))
    theirs = engine_param_states(saving)
    for name, state in engine_param_states(engine).items():
        assert_same(state, theirs[name], name)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_key_takes_booleans_only(value):
    from deepspeed_bnb.runtime.zero.config import BnbZeroConfig
    with pytest.raises(ValueError, match="bnb_convert_stock_on_load must be true or false"):
        BnbZeroConfig(stage=2, bnb_convert_stock_on_load=value)
