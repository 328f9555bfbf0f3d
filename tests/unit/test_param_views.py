"""DeepSpeed's per-step re-pointing of tensors at their flat buffers, skipped where it would change nothing: the
model's parameters (stages 1/2) and parameter partitions (stage 3) view exactly what DeepSpeed's own
`_update_model_bit16_weights` / `_unflatten_partitioned_parameters` gives them, after every step and after anything
moved them; the call is skipped only while nothing did.

Oracle: DeepSpeed's own method, called on the same engine (it must change nothing after our step). Controls: a
stock engine calls it for every group at every step; a reassigned `.data`, a moved flat buffer, a tensor replaced in
DeepSpeed's list, and each kind of view change (pointer, shape, strides, dtype) make the record answer no.
"""

import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import deepspeed_bnb  # noqa: F401  (DeepSpeed's classes with deepspeed_bnb's integration, as users get them)
from deepspeed_bnb.runtime.zero.param_views import ParamViews
from support.toy import build_engine, train_steps

STOCK_METHOD = DeepSpeedZeroOptimizer._update_model_bit16_weights
STOCK_STAGE3_METHOD = DeepSpeedZeroOptimizer_Stage3._unflatten_partitioned_parameters


def views(engine) -> dict:
    """name -> (data pointer, shape, strides, dtype) of each of the model's parameters."""
    return {n: (p.data_ptr(), p.shape, p.stride(), p.dtype) for n, p in engine.module.named_parameters()}


def inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end


def counting(monkeypatch, owner, name, method) -> list:
    """The group indices DeepSpeed's own `method` is called with from now on (it still runs)."""
    seen = []

    def counted(self, index):
        seen.append(index)
        return method(self, index)
    monkeypatch.setattr(owner, name, counted)
    return seen


@pytest.fixture
def calls(monkeypatch):
    return counting(monkeypatch, DeepSpeedZeroOptimizer, "_update_model_bit16_weights", STOCK_METHOD)


def test_parameters_view_what_deepspeeds_method_gives_them(one_rank, calls):
    engine = build_engine()
    optimizer = engine.optimizer
    groups = len(optimizer.bit16_groups)
    train_steps(engine, range(2))
    calls.clear()
    train_steps(engine, range(2, 5))
    assert calls == []  # nothing moved: DeepSpeed's re-pointing skipped at every step
    after = views(engine)
    for i in range(groups):  # the oracle: DeepSpeed's own method changes nothing
        STOCK_METHOD(optimizer, i)
    assert views(engine) == after
    flats = optimizer.bit16_groups_flat
    assert all(any(inside(p, flat) for flat in flats) for p in engine.module.parameters())

    # a parameter whose .data was replaced (by a user, or another feature) is pointed back as DeepSpeed does
    name, param = next((n, p) for n, p in engine.module.named_parameters() if p.dim() == 2)
    group = next(i for i, g in enumerate(optimizer.bit16_groups) if any(q is param for q in g))
    param.data = param.data.clone()
    assert views(engine)[name] != after[name]
    calls.clear()
    train_steps(engine, range(5, 6))
    assert calls == [group]
    assert any(inside(param, flat) for flat in flats)
    pointed = views(engine)
    STOCK_METHOD(optimizer, group)
    assert views(engine) == pointed

    # a flat buffer that moved (its storage replaced): every parameter of its group follows it
    optimizer.bit16_groups_flat[0].data = optimizer.bit16_groups_flat[0].data.clone()
    calls.clear()
    engine.optimizer._update_model_bit16_weights(0)
    assert calls == [0]
    assert all(inside(p, optimizer.bit16_groups_flat[0]) for p in optimizer.bit16_groups[0])


def partitions(optimizer) -> list:
    """(data pointer, shape, strides, dtype) of each parameter partition of each sub-group (stage 3)."""
    return [[(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in group]
            for group in optimizer.fp16_partitioned_groups]


def test_stage3_partitions_view_what_deepspeeds_method_gives_them(one_rank, monkeypatch):
    calls = counting(monkeypatch, DeepSpeedZeroOptimizer_Stage3, "_unflatten_partitioned_parameters",
                     STOCK_STAGE3_METHOD)
    engine = build_engine(stage=3)
    optimizer = engine.optimizer
    train_steps(engine, range(2))
    calls.clear()
    losses = train_steps(engine, range(2, 4))
    assert calls == []
    after = partitions(optimizer)
    for i in range(len(optimizer.fp16_partitioned_groups)):  # the oracle: DeepSpeed's own method changes nothing
        STOCK_STAGE3_METHOD(optimizer, i)
    assert partitions(optimizer) == after
    # a partition replaced in DeepSpeed's list (the same values elsewhere) is pointed into the buffer as DeepSpeed does
    group = optimizer.fp16_partitioned_groups[0]
    group[0] = group[0].clone()
    train_steps(engine, range(4, 5))
    assert calls == [0]
    flat = optimizer.fp16_partitioned_groups_flat[0]
    assert group[0].data_ptr() == flat.data_ptr()
    # the training itself: the same losses as an engine whose every step re-points (DeepSpeed's own method)
    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "_unflatten_partitioned_parameters", STOCK_STAGE3_METHOD)
    from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
    monkeypatch.setattr(BnbZeroStage3Optimizer, "_unflatten_partitioned_parameters", STOCK_STAGE3_METHOD)
    reference = build_engine(stage=3)
    train_steps(reference, range(2))
    assert train_steps(reference, range(2, 4)) == losses


def test_a_stock_engine_repoints_every_group_at_every_step(one_rank, calls):
    engine = build_engine(stock=True)  # the control: DeepSpeed's own step
    train_steps(engine, range(1))
    calls.clear()
    train_steps(engine, range(1, 3))
    assert sorted(calls) == sorted(list(range(len(engine.optimizer.bit16_groups))) * 2)


def test_the_record_answers_no_to_every_kind_of_move():
    flat = torch.arange(64, dtype=torch.bfloat16)  # 2-byte: float16 views the same bytes in the same shape
    square, row = flat[:16].view(4, 4), flat[16:24]

    def fresh():
        a, b = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
        a.data, b.data = square, row
        return a, b

    a, b = fresh()
    assert ParamViews.of(flat, [a, b, a]).hold(flat, [a, b, a])  # nothing moved
    moves = {
        "a copy": lambda a, b, f: setattr(a, "data", a.data.clone()),
        "another shape, same pointer": lambda a, b, f: setattr(b, "data", b.data.view(2, 4)),
        "other strides, same pointer and shape": lambda a, b, f: setattr(a, "data", a.data.t()),
        "another dtype, same pointer and shape": lambda a, b, f: setattr(b, "data", b.data.view(torch.float16)),
        "the buffer's storage replaced": lambda a, b, f: setattr(f, "data", f.data.clone()),
    }
    for what, move in moves.items():
        buffer = flat.clone()
        a, b = fresh()
        a.data, b.data = buffer[:16].view(4, 4), buffer[16:24]
        record = ParamViews.of(buffer, [a, b])
        assert record.hold(buffer, [a, b]), what
        move(a, b, buffer)
        assert not record.hold(buffer, [a, b]), what
    a, b = fresh()
    record = ParamViews.of(flat, [a, b])
    assert not record.hold(flat.clone(), [a, b])  # another buffer object
    c = torch.nn.Parameter(torch.empty(0))
    c.data = b.data
    assert not record.hold(flat, [a, c])  # another tensor in the list, viewing the same place
    assert not record.hold(flat, [a])  # one fewer
