"""`deepspeed-bnb convert` reads stock DeepSpeed ZeRO-3 checkpoints of torch's AdamW.

Source: a stock ZeRO-3 run of torch.optim.AdamW at 2 ranks with frozen parameters (the shared launches'
distributed_scenarios.scenario_stock_zero3_save), its state gathered at save by DeepSpeed's own API
(safe_get_full_optimizer_state, safe_get_full_fp32_param). Converted at its DP size to bnb's 32-bit AdamW and to
AdamW8bit, each loaded into a one-rank ZeRO-3 engine of that optimizer (so across a DP change) and read back by
parameter: the 32-bit moments and every fp32 weight equal DeepSpeed's, the 8-bit moments within half a quantization
step of them, the frozen weights as saved; three more steps track the stock run's (bnb's AdamW against torch's).
"""

import os

import pytest
import torch

from support.scenario_runs import SIZES

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(2 not in SIZES, reason=f"needs the DP-2 launch (scenario sizes {SIZES})")]
ROUNDING = 1e-6  # relative: a code's value is qmap * absmax, rounded once in fp32


@pytest.fixture(scope="module")
def stock(scenario_results, scenario_folder):
    from support.distributed_scenarios import STOCK_ZERO3
    folder = os.path.join(scenario_folder, STOCK_ZERO3, "dp2")
    reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
    return folder, reference, scenario_results[2]["stock_zero3_save"]["continued"]


def loaded_engine(folder: str, eight_bit: bool):
    """A one-rank ZeRO-3 engine of bnb's AdamW (8-bit or 32-bit state) with the scenario's frozen parameters, loaded
    from `folder`."""
    import bitsandbytes as bnb
    import deepspeed

    from support.distributed_scenarios import FROZEN
    from support.toy import MIN_8BIT_SIZE, ds_config, freeze, make_model, param_groups
    model = make_model(seed=1)
    groups = freeze(model, FROZEN, param_groups(model, lr=5e-2))
    optimizer = bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE) if eight_bit else bnb.optim.AdamW(groups)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=3))
    engine.load_checkpoint(folder)
    return engine


def by_name(engine) -> dict:
    """name -> (flattened weights, bnb state) of every parameter of a one-rank ZeRO-3 engine (state None: frozen)."""
    import deepspeed

    from support.bnb_state import engine_param_states
    states = engine_param_states(engine)
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: (p.detach().reshape(-1).clone(), states.get(name)) for name, p in params.items()}


@pytest.mark.parametrize("to", ["32bit", "8bit"])
def test_stock_zero3_adamw_converts_and_loads(stock, tmp_path, to):
    from deepspeed_bnb.checkpoint.tools.convert import convert
    from deepspeed_bnb.ops.reference import code_gap
    from support.bnb_state import bnb_moments
    from support.toy import MIN_8BIT_SIZE, train_steps
    folder, reference, continued = stock
    report = convert(folder, str(tmp_path / to), to, min_8bit_size=MIN_8BIT_SIZE, progress=False)
    trained = [name for name, ref in reference.items() if "fp32" in ref]
    assert f"{len(trained)} parameters" in report, report
    engine = loaded_engine(str(tmp_path / to), eight_bit=to == "8bit")
    eight_bit = 0
    for name, (weights, state) in by_name(engine).items():
        ref = reference[name]
        if "frozen" in ref:
            assert state is None and torch.equal(weights, ref["frozen"]), name
            continue
        assert torch.equal(weights, ref["fp32"]), name
        moments = bnb_moments(state, weights.numel())
        for key, torch_key in (("state1", "exp_avg"), ("state2", "exp_avg_sq")):
            got, expected = moments[key].reshape(-1), ref[torch_key]
            if state[key].dtype == torch.uint8:
                eight_bit += 1
                gap = code_gap(expected, state[f"absmax{key[-1]}"], state[f"qmap{key[-1]}"])
                assert torch.all((got - expected).abs() <= 0.5 * gap + ROUNDING * expected.abs()), (name, key)
            else:
                assert torch.equal(got, expected), (name, key)
        assert int(state["step"]) == 3, name
    assert eight_bit == (0 if to == "32bit" else 2 * 3)  # fc1.weight, fc2.weight, head.weight (emb is frozen)
    losses = train_steps(engine, range(3, 6))
    assert max(abs(a - b) for a, b in zip(losses, continued)) < (1e-4 if to == "32bit" else 1e-2), (losses, continued)


def test_two_ranks_resume_it_in_zero3_converted_at_load(scenario_results):
    """bnb_convert_stock_on_load at DP 2 into a ZeRO-3 engine of AdamW8bit with the same parameters frozen: rank 0
    converts, both ranks load; the next 3 losses within 1e-3 of the stock run's (measured: 1.7e-5), the weights alone
    with fresh moments beyond it (6.7e-3), and no scratch folder is left."""
    from support.distributed_scenarios import assert_resumed_at_load
    assert_resumed_at_load(scenario_results[2]["stock_zero3_save"])
