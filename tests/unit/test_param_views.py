"""DeepSpeed's per-step re-pointing of the model's parameters at their flat buffers, skipped where it would change
nothing: parameters view exactly what DeepSpeed's own `_update_model_bit16_weights` gives them, after every step and
after anything moved them; its call is skipped only while nothing did.

Oracle: DeepSpeed's own method, called on the same engine (it must change nothing after our step). Controls: a
stock engine calls it for every group at every step; a reassigned `.data`, a moved flat buffer, and each kind of view
change (pointer, shape, strides, dtype) make the record answer no.
"""

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

import deepspeed_bnb  # noqa: F401  (DeepSpeed's classes with deepspeed_bnb's integration, as users get them)
from deepspeed_bnb.runtime.zero.param_views import ParamViews
from support.toy import build_engine, train_steps

STOCK_METHOD = DeepSpeedZeroOptimizer._update_model_bit16_weights


def views(engine) -> dict:
    """name -> (data pointer, shape, strides, dtype) of each of the model's parameters."""
    return {n: (p.data_ptr(), p.shape, p.stride(), p.dtype) for n, p in engine.module.named_parameters()}


def inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.numel() * tensor.element_size() <= end


@pytest.fixture
def calls(monkeypatch):
    """The group indices DeepSpeed's own _update_model_bit16_weights is called with (it still runs)."""
    seen = []

    def counted(self, group_index):
        seen.append(group_index)
        return STOCK_METHOD(self, group_index)
    monkeypatch.setattr(DeepSpeedZeroOptimizer, "_update_model_bit16_weights", counted)
    return seen


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
    assert ParamViews.of(flat, [a, b, a]).hold(flat)  # each tensor once, nothing moved
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
        assert record.hold(buffer), what
        move(a, b, buffer)
        assert not record.hold(buffer), what
    a, b = fresh()
    assert not ParamViews.of(flat, [a, b]).hold(flat.clone())  # another buffer object
