"""`deepspeed-bnb convert` moves a run of bnb AdamW8bit under stock DeepSpeed to deepspeed_bnb, moments included.

Source: a stock ZeRO-2 run of AdamW8bit at 2 ranks (the shared launches' distributed_scenarios.scenario_stock_bnb_save),
its moments taken at save from each rank's bnb state of its flat partition, dequantized by bitsandbytes itself and cut
at DeepSpeed's own fragment addresses. Converted at its DP size to bnb's 32-bit AdamW and to AdamW8bit, each loaded into
a one-rank engine (so across a DP change, 2 -> 1) and read back by parameter: the 32-bit moments and every fp32 weight
equal the reference, the 8-bit moments within one quantization step of it (deepspeed_bnb's block-aligned blocks are not
stock's, so the codes are requantized); three more steps track the stock run's within 1e-2. Control: a load of the stock
tag with its optimizer state is refused, naming convert.
"""

import os

import pytest
import torch

from support.scenario_runs import SIZES

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(2 not in SIZES, reason=f"needs the DP-2 launch (scenario sizes {SIZES})")]


@pytest.fixture(scope="module")
def stock(scenario_results, scenario_folder):
    from support.distributed_scenarios import STOCK_BNB
    folder = os.path.join(scenario_folder, STOCK_BNB, "dp2")
    reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
    return folder, reference, scenario_results[2]["stock_bnb_save"]["continued"]


@pytest.mark.parametrize("to", ["32bit", "8bit"])
def test_a_stock_zero2_run_of_adamw8bit_converts_with_its_moments(stock, one_rank, tmp_path, to):
    import bitsandbytes as bnb

    from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
    from deepspeed_bnb.checkpoint.tools.convert import convert
    from support.bnb_state import assert_holds_moments, engine_param_states
    from support.toy import MIN_8BIT_SIZE, build_engine, gathered_weights, train_steps
    folder, reference, continued = stock
    eight_bit = to == "8bit"
    optimizer = bnb.optim.AdamW8bit if eight_bit else bnb.optim.AdamW
    if eight_bit:  # control (once): the stock tag's optimizer state is not loaded directly
        with pytest.raises(CheckpointMismatchError, match="deepspeed-bnb convert CHECKPOINT OUT --to 8bit"):
            build_engine(optimizer, seed=1, min_8bit_size=MIN_8BIT_SIZE).load_checkpoint(folder)
    report = convert(folder, str(tmp_path / to), to, min_8bit_size=MIN_8BIT_SIZE, progress=False)
    assert "round-trip error" in report
    kwargs = {"min_8bit_size": MIN_8BIT_SIZE} if eight_bit else {}
    engine = build_engine(optimizer, seed=1, lr=5e-2, **kwargs)  # another seed and lr: both come from the checkpoint
    engine.load_checkpoint(str(tmp_path / to))
    states, weights = engine_param_states(engine), gathered_weights(engine)
    assert states.keys() == reference.keys()
    quantized = 0
    for name, expected in reference.items():
        assert torch.equal(weights[name].reshape(-1), expected["fp32"]), name
        quantized += assert_holds_moments(states[name], [expected["exp_avg"], expected["exp_avg_sq"]], name)
    assert (quantized > 0) == eight_bit
    assert [g["lr"] for g in engine.optimizer.param_groups] == [1e-3, 5e-4]  # the stock run's
    # (the stock run steps on in 8 bits: requantized, or 32-bit state, the next losses stay within 1e-2 of it)
    assert max(abs(a - b) for a, b in zip(train_steps(engine, range(3, 6)), continued)) < 1e-2


def test_two_ranks_resume_the_stock_run_converted_at_load(scenario_results):
    """bnb_convert_stock_on_load at DP 2: rank 0 converts, both ranks load; the next 3 losses track the stock run's
    within 1e-3 (measured: 1.7e-4), and no scratch folder is left. Control: the weights alone with fresh moments miss
    that bound (measured: 6.5e-3), so the moments were carried over."""
    from support.distributed_scenarios import assert_resumed_at_load
    assert_resumed_at_load(scenario_results[2]["stock_bnb_save"])


def test_two_ranks_resume_a_stock_lion8bit_run_converted_at_load(scenario_results):
    """The same for a stock run of bnb's Lion8bit (one state) into a Lion8bit engine: its momentum carried over (the
    control, fresh state, misses the bound)."""
    from support.distributed_scenarios import assert_resumed_at_load
    assert_resumed_at_load(scenario_results[2]["stock_lion_save"])
