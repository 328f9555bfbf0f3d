"""What one `engine.step()` calls: the fused operator once per partition, bnb's update only where the plan says, and
no read of a tensor back to the host (`.item()`, `float(t)`, `bool(t)`), which on a GPU waits for every queued
kernel.

Counted under a TorchDispatchMode, which sees every operator call, ours and bitsandbytes' (torch.library operators)
and aten's, on the CPU as on a GPU. The reference for host reads is stock DeepSpeed stepping torch's fused AdamW with
the same config: what DeepSpeed itself reads (its invalid-norm check, for one) is not ours to remove. Control: a step
that reads the unscale factor back (what an earlier version did) is counted, so the harness can fail.
"""

import contextlib
import functools
from collections import Counter

import deepspeed
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepspeed_bnb  # noqa: F401
from support.bnb_optimizers import FACTORIES
from deepspeed_bnb.ops import rules, self_check
from deepspeed_bnb.optim import batched_update
from deepspeed_bnb.optim.fused import partition_step
from deepspeed_bnb.optim.master_weights import MODES
from deepspeed_bnb.runtime.engine import stock_deepspeed
from support.toy import MIN_8BIT_SIZE, ds_config, global_batch, loss_fn, make_model, param_groups

HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal")
KERNEL = "deepspeed_bnb::adam8bit_step_"
BNB_8BIT, BNB_32BIT = "bitsandbytes::optimizer_update_8bit_blockwise", "bitsandbytes::optimizer_update_32bit"


class OperatorCounter(TorchDispatchMode):
    """Counts every operator called inside it, by its schema name."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))

    def host_reads(self) -> int:
        return sum(self.counts[name] for name in HOST_READS)


def _engine(optimizer, stage: int, stock: bool = False, **settings):
    # clipping on: DeepSpeed hands a device tensor as the factor
    config = ds_config(1, stage=stage, clip=0.5, **settings)
    if stage == 3:
        config["zero_optimization"]["sub_group_size"] = 6000  # several sub-groups, so several partitions
    with stock_deepspeed() if stock else contextlib.nullcontext():
        engine, *_ = deepspeed.initialize(model=optimizer.model, optimizer=optimizer, config=config)
    return engine


def _bnb(model):
    optimizer = FACTORIES["AdamW8bit"](param_groups(model))
    optimizer.model = model
    return optimizer


def _torch_fused(model):
    optimizer = torch.optim.AdamW(param_groups(model), fused=True)
    optimizer.model = model
    return optimizer


def _counted_steps(engine, steps: int = 2) -> OperatorCounter:
    """The operators of the last of `steps` optimizer steps (the first may allocate and route)."""
    counter = None
    for step in range(steps):
        tokens, targets = global_batch(step)
        engine.backward(loss_fn(engine, tokens, targets))
        counter = OperatorCounter()
        with counter:
            engine.step()
    return counter


def _partitions(engine):
    """(fused segment count, bnb segment count) per partition step of a deepspeed_bnb engine."""
    return [(0 if s.fused is None else int(s.fused.table.shape[0]), len(s._bnb)) for s in engine.optimizer.bnb_steps]


@pytest.mark.parametrize("stage", [2, 3])
def test_one_kernel_call_per_partition_and_no_bnb_call(one_rank, stage):
    """On a CPU the fused kernel steps every parameter of a partition in one call: the 8-bit ones, and the 32-bit ones
    in bnb's own 32-bit CPU arithmetic (ops/rules.py: bnb_cpu; tests/kernels/test_bnb_cpu32.py holds it to bnb)."""
    engine = _engine(_bnb(make_model(0)), stage)
    plan = _partitions(engine)
    counter = _counted_steps(engine)
    assert len(plan) >= 2, "the toy model gives several partitions (two param groups, or several sub-groups)"
    assert engine.optimizer.bnb_arithmetic == rules.BNB_CPU
    assert all(bnb == 0 for _, bnb in plan)
    assert counter.counts[KERNEL] == len(plan)
    assert counter.counts[BNB_32BIT] == counter.counts[BNB_8BIT] == 0
    eight_bit = sum(p.numel() >= MIN_8BIT_SIZE for p in engine.module.parameters())
    assert sum(fused for fused, _ in plan) > eight_bit  # the 32-bit-state parameters are the kernel's too


@pytest.mark.parametrize("stage", [2, 3])
def test_control_bnb_steps_32bit_state_where_the_kernels_copy_differs(one_rank, stage, monkeypatch):
    """Where the kernel's copy of bnb's 32-bit CPU update fails its check against bnb (planted here), the kernel keeps
    the 8-bit parameters and bnb's own update the 32-bit ones, all of a partition's small ones in one call
    (optim/batched_update.py; they share a config here); without batching, one bnb call per 32-bit segment."""
    real = self_check.disagreement
    monkeypatch.setattr(self_check, "disagreement", lambda rule, device, master="fp32", arithmetic=None:
                        "planted" if arithmetic == rules.BNB_CPU else real(rule, device, master, arithmetic))
    with pytest.warns(RuntimeWarning, match="32-bit CPU update differs from it on this machine"):
        engine = _engine(_bnb(make_model(0)), stage)
    plan = _partitions(engine)
    counter = _counted_steps(engine)
    assert engine.optimizer.bnb_arithmetic == rules.IEEE
    assert counter.counts[KERNEL] == sum(1 for fused, _ in plan if fused)
    assert counter.counts[BNB_32BIT] == sum(1 for _, bnb in plan if bnb) > 0
    assert counter.counts[BNB_8BIT] == 0  # every 8-bit parameter is the kernel's
    monkeypatch.setattr(batched_update, "allowed", lambda rule, device: False)
    assert _counted_steps(engine).counts[BNB_32BIT] == sum(bnb for _, bnb in plan) > sum(1 for _, b in plan if b)


# the training precision and master weights: fp32 training (the default master weights), then bf16 training (what a
# GPU user runs) in each master-weights mode: the model's copy written by the kernel, bf16 master weights stepped in
# place, compensated ones with their error terms
PRECISIONS = [(False, None)] + [(True, mode) for mode in MODES]


@functools.lru_cache(maxsize=None)
def _stock_host_reads(stage: int, bf16: bool) -> int:
    """Stock DeepSpeed's host reads in one step of torch's fused AdamW: one engine per stage and precision, shared by
    the master-weights modes (they are ours, not stock's)."""
    return _counted_steps(_engine(_torch_fused(make_model(0)), stage, stock=True, bf16=bf16)).host_reads()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("bf16, master", PRECISIONS, ids=["fp32"] + [f"bf16-{mode}" for mode in MODES])
def test_step_reads_no_more_tensors_back_than_stock_deepspeed(one_rank, stage, bf16, master):
    engine = _engine(_bnb(make_model(0)), stage, **({"bf16": True, "bnb_master_weights": master} if bf16 else {}))
    if bf16:
        assert engine.optimizer.bnb_master.mode == master
    ours = _counted_steps(engine)
    assert ours.counts[KERNEL] == len(engine.optimizer.bnb_steps)
    assert ours.host_reads() <= _stock_host_reads(stage, bf16), ours.counts


def test_control_a_step_that_reads_the_factor_back_is_counted(one_rank, monkeypatch):
    """Control: the factor read back once per partition (an earlier version's `.item()`) shows in the count."""
    engine = _engine(_bnb(make_model(0)), 2)
    clean = _counted_steps(engine).host_reads()
    real = partition_step.PartitionStep.step

    def reading(self, group, params, grads, state, inv_scale=None, master_error=None, **kwargs):
        float(inv_scale)
        return real(self, group, params, grads, state, inv_scale, master_error, **kwargs)

    monkeypatch.setattr(partition_step.PartitionStep, "step", reading)
    assert _counted_steps(engine).host_reads() == clean + len(engine.optimizer.bnb_steps)
