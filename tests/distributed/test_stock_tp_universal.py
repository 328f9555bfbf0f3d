"""DeepSpeed's universal checkpoint of a stock tensor-parallel run loads into a deepspeed_bnb tensor-parallel engine.

ds_to_universal joins every trained parameter's fp32 weights and moments across the tensor-parallel ranks, but copies
model-parallel rank 0's model states: their param_shapes are rank 0's slices, and the frozen parameters there are rank
0's share. Source: a stock AutoTP run (torch AdamW, 2 ranks, ZeRO-2, a row-cut, a column-cut and a replicated frozen
weight), converted by DeepSpeed's converter (without its strict check, which stops on frozen parameters), loaded by
an AutoTP engine of AdamW8bit built from another seed (tests/support/stock_tp_universal.py). Each rank's trained
weights are the stock run's slices exactly; the frozen ones are left at the loader's own values, with a warning naming
them. Control: the loader's trained weights differed before the load.
"""

import os

import deepspeed
import pytest
import torch
from packaging.version import Version

from conftest import torchrun

pytestmark = [pytest.mark.multi_rank, pytest.mark.skipif(
    Version(Version(deepspeed.__version__).base_version) < Version("0.19.0"),
    reason="DeepSpeed writes AutoTP's conversion schema, which ds_to_universal needs, from 0.19.0 on")]


def test_a_stock_tensor_parallel_universal_checkpoint_loads_at_tensor_parallel_2(tmp_path):
    from support.parallel_scenarios import FROZEN
    launch = torchrun("support/stock_tp_universal.py", 2, str(tmp_path))
    for rank in range(2):
        held = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"), weights_only=False)
        trained = held["trained"]
        assert trained and not set(trained) & set(FROZEN[False])
        assert any(not torch.equal(held["before"][name], held["saved"][name]) for name in trained)  # control
        for name in trained:
            assert torch.equal(held["loaded"][name], held["saved"][name]), (rank, name)
        for name in FROZEN[False]:
            assert torch.equal(held["loaded"][name], held["before"][name]), (rank, name)  # the loader's own
    output = " ".join((launch.stdout + launch.stderr).split())  # the warning, as the publishing rank printed it
    assert "rank 0's share of the frozen parameters ['model.layers.0.mlp.down_proj.weight'" in output, output[-3000:]
