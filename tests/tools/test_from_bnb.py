"""A run started with plain bitsandbytes (no DeepSpeed) continues under ZeRO: `deepspeed-bnb convert --from-bnb`.

Both state-dict layouts: bitsandbytes >= 0.49.2's `optimizer.state_dict()` (quantization tensors under
`__bnb_optimizer_quant_state__`) and the flat one of bitsandbytes < 0.49.2, which had no state_dict override: torch's
`Optimizer.state_dict` (called here on the same optimizer, as those versions did). Reference: the plain run itself.
After conversion an engine holds every state byte and weight of the plain optimizer, at DP 1 and reshaped to DP 3 /
ZeRO-3, and two more steps give the plain run's losses. Controls: names in the wrong order are refused (the
state-dict order is not the optimizer's here: the toy puts weights and biases in separate groups); a torch AdamW
state dict is refused; so is the state for another rule's class (AdamW's state2 for Lion8bit).
"""

import os

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.checkpoint.tools.from_bnb import QUANT_STATE_KEY
from deepspeed_bnb.cli import main
from support.bnb_state import flat_param_states
from support.toy import MIN_8BIT_SIZE, build_engine, make_model, param_groups, train_plain, train_steps

STEPS = 3


def plain_run():
    model = make_model(0)
    optimizer = bnb.optim.AdamW8bit(param_groups(model), min_8bit_size=MIN_8BIT_SIZE)
    train_plain(model, optimizer, range(STEPS))
    return model, optimizer


def group_order_names(model):
    """Parameter names in the order the optimizer got them (param_groups' order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in param_groups(model) for p in group["params"]]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    model, optimizer = plain_run()
    new_layout = optimizer.state_dict()
    assert any(QUANT_STATE_KEY in s for s in new_layout["state"].values())  # bitsandbytes >= 0.49.2's layout
    old_layout = torch.optim.Optimizer.state_dict(optimizer)  # what bitsandbytes < 0.49.2 returned
    assert not any(QUANT_STATE_KEY in s for s in old_layout["state"].values())
    torch.save({"model": model.state_dict(), "optimizer": new_layout}, root / "new.pt")
    torch.save({"model": model.state_dict(), "optimizer": old_layout}, root / "old.pt")
    with open(root / "names.txt", "w") as f:
        f.write("\n".join(group_order_names(model)))
    names = group_order_names(model)
    params = dict(model.named_parameters())
    reference = {name: dict(optimizer.state[params[name]]) for name in names}
    return root, reference, {n: p.detach().clone() for n, p in params.items()}


@pytest.mark.parametrize("layout", ["new", "old"])
def test_plain_bnb_run_continues_under_zero(one_rank, plain, tmp_path, layout):
    root, reference, weights = plain
    out = str(tmp_path / "ckpt")
    assert main(["convert", str(root / f"{layout}.pt"), out, "--from-bnb", "--weights", str(root / f"{layout}.pt"),
                 "--param-names", str(root / "names.txt"), "--quiet"]) == 0
    main(["reshape", out, str(tmp_path / "dp3"), "--dp", "3", "--stage", "3", "--quiet"])
    for folder in (out, str(tmp_path / "dp3")):
        engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, seed=1, lr=5e-2)
        engine.load_checkpoint(folder)
        names = engine.optimizer.param_names
        for p, state in flat_param_states(engine).items():
            expected = reference[names[p]]
            assert set(state) == set(expected) - {"unorm_vec"}, names[p]
            for key, value in state.items():
                if torch.is_tensor(value):
                    assert torch.equal(value, expected[key].reshape(value.shape)), (names[p], key)
                else:
                    assert value == expected[key], (names[p], key)
            assert torch.equal(p.detach(), weights[names[p]]), names[p]
    model, optimizer = plain_run()  # the plain run, continued
    from support.toy import global_batch, loss_fn
    plain_losses = []
    for step in range(STEPS, STEPS + 2):
        tokens, targets = global_batch(step)
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        plain_losses.append(loss.item())
    assert train_steps(engine, range(STEPS, STEPS + 2)) == pytest.approx(plain_losses, abs=1e-6)


def test_names_in_the_wrong_order_are_refused(plain, tmp_path, capsys):
    root, *_ = plain
    assert main(["convert", str(root / "new.pt"), str(tmp_path / "o"), "--from-bnb", "--weights",
                 str(root / "new.pt"), "--quiet"]) == 2
    assert "not in the optimizer's order (pass --param-names)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_torch_adamw_state_is_refused(plain, tmp_path, capsys):
    root, *_ = plain
    model = make_model(0)
    optimizer = torch.optim.AdamW(param_groups(model))
    train_plain(model, optimizer, range(1))
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "torch.pt")
    assert main(["convert", str(tmp_path / "torch.pt"), str(tmp_path / "o"), "--from-bnb", "--weights",
                 str(tmp_path / "torch.pt"), "--param-names", str(root / "names.txt"), "--quiet"]) == 2
    assert "not bitsandbytes' (state1, ...)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_another_rules_state_is_refused_not_cut(plain, tmp_path, capsys):
    """The AdamW8bit run's state for Lion8bit's class (one state): its state2 would be dropped if carried over (and
    was, silently, before this check). Refused naming the key, nothing written. Control: the same file for the run's
    own class converts (test_plain_bnb_run_continues_under_zero)."""
    root, *_ = plain
    assert main(["convert", str(root / "new.pt"), str(tmp_path / "o"), "--from-bnb", "--weights", str(root / "new.pt"),
                 "--param-names", str(root / "names.txt"), "--optimizer-class", "bitsandbytes.optim.Lion8bit",
                 "--quiet"]) == 2
    assert "has ['state2'], which the optimizer class given does not keep" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


def test_an_engine_with_a_scheduler_loads_it_with_a_warning(one_rank, plain, tmp_path, monkeypatch):
    """The plain run's state dict has no DeepSpeed scheduler state: stock DeepSpeed would fail on
    checkpoint['lr_scheduler'] after replacing the weights; here the engine's scheduler is kept, with a warning."""
    import deepspeed
    from support.toy import ds_config
    root, reference, _ = plain
    out = str(tmp_path / "ckpt")
    assert main(["convert", str(root / "new.pt"), out, "--from-bnb", "--weights", str(root / "new.pt"),
                 "--param-names", str(root / "names.txt"), "--quiet"]) == 0
    model = make_model(1)
    config = {**ds_config(1), "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model),
                                                                             min_8bit_size=MIN_8BIT_SIZE),
                                  config=config)[0]
    with pytest.warns(RuntimeWarning, match="holds no lr scheduler state"):
        engine.load_checkpoint(out)
    names = engine.optimizer.param_names
    for p, state in flat_param_states(engine).items():
        assert torch.equal(state["state1"], reference[names[p]]["state1"].reshape(state["state1"].shape))
    import deepspeed_bnb.runtime.checkpointing as bnb_engine  # control: without the check, DeepSpeed's own load fails
    monkeypatch.setattr(bnb_engine, "_holds_scheduler", lambda *args: True)
    with pytest.raises(KeyError, match="lr_scheduler"):
        engine.load_checkpoint(out)
