"""The control of the compatibility matrix: the installed DeepSpeed, stock (every deepspeed_bnb override taken back),
with torch.optim.AdamW, trains the toy model at ZeRO-1, 2 and 3 on this torch and resumes a checkpoint exactly.

Where a DeepSpeed release fails the matrix's claims, this says whether the release runs here at all: a failure of both
is the release's (or torch's), a failure of the claims alone is deepspeed_bnb's.
"""

import pytest
import torch

from deepspeed_bnb.installer import stock_deepspeed
from support.toy import ds_config, make_model, param_groups, train_steps


def stock_engine(stage: int):
    import deepspeed
    model = make_model(0)
    with stock_deepspeed():
        return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                    config=ds_config(1, stage=stage))[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stock_deepspeed_trains_and_resumes(one_rank, tmp_path, stage):
    with stock_deepspeed():
        engine = stock_engine(stage)
        losses = train_steps(engine, range(6))
        engine.save_checkpoint(str(tmp_path), tag="t")
        continued = train_steps(engine, range(6, 9))
        resumed = stock_engine(stage)
        resumed.load_checkpoint(str(tmp_path), tag="t")
        again = train_steps(resumed, range(6, 9))
    assert type(engine.optimizer).__module__.startswith("deepspeed.")
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert again == continued
