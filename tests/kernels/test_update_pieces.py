"""bitsandbytes' own update is called on block-aligned pieces of at most bnb_update.MAX_UPDATE_NUMEL elements (its CUDA
update counts elements in 32 bits), and the pieces' updates are the update of the whole tensor.

The limit is 2^30 in training; here it is lowered to 512 elements so that the toy model's 8-bit parameters (about
12k elements) and 32-bit ones (a few thousand) are cut into many pieces. Reference: plain bitsandbytes on the same
model and data, bit for bit (weights and every parameter's state). Controls: the engine really made more update calls
than it has parameters, and a split that is off by one block does not match. A per-tensor trust ratio on such a
parameter (LAMB/LARS with 32-bit state) is refused by name at initialize.
"""

import bitsandbytes as bnb
import deepspeed
import pytest

import deepspeed_bnb  # noqa: F401
from support.bnb_optimizers import FACTORIES
from support.bnb_state import assert_equals_plain
from support.planted_bugs import split_one_block_early
from deepspeed_bnb.ops import bnb_update
from deepspeed_bnb.state_layout import BLOCK_SIZE, Segment, split_segment
from support.toy import clone, ds_config, make_model, param_groups, train_plain, train_steps

SMALL_LIMIT = 2 * BLOCK_SIZE


@pytest.mark.parametrize("fp32_offset", [-1, 700])
def test_split_segment_covers_the_segment_in_block_aligned_pieces(fp32_offset):
    segment = Segment(slot=3, param_start=1024, numel=5 * BLOCK_SIZE + 17, offset=2048, eight_bit=fp32_offset < 0,
                      fp32_offset=fp32_offset)
    pieces = split_segment(segment, 2 * BLOCK_SIZE)
    assert [p.numel for p in pieces] == [512, 512, 256 + 17]
    assert all(p.offset % BLOCK_SIZE == 0 and p.param_start % BLOCK_SIZE == 0 for p in pieces)
    assert [p.offset - segment.offset for p in pieces] == [0, 512, 1024]
    assert [p.param_start - segment.param_start for p in pieces] == [0, 512, 1024]
    assert [p.fp32_offset for p in pieces] == ([-1] * 3 if fp32_offset < 0 else [700, 1212, 1724])
    assert {(p.slot, p.eight_bit) for p in pieces} == {(3, segment.eight_bit)}
    assert split_segment(segment, 8 * BLOCK_SIZE) == (segment,)  # short enough: itself
    with pytest.raises(ValueError, match="multiple of 256"):
        split_segment(segment, 300)


def counting_update_steps(monkeypatch, optimizer_cls):
    calls = []
    original = optimizer_cls.update_step

    def update_step(self, group, p, gindex, pindex):
        calls.append(p.numel())
        return original(self, group, p, gindex, pindex)
    monkeypatch.setattr(optimizer_cls, "update_step", update_step)
    return calls


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW_32bit", "Lion8bit"])
def test_update_in_pieces_equals_plain_bnb(one_rank, monkeypatch, name):
    monkeypatch.setattr(bnb_update, "MAX_UPDATE_NUMEL", SMALL_LIMIT)
    model = make_model(0)
    reference = clone(model)
    optimizer = FACTORIES[name](param_groups(model))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=ds_config(1, stage=2, bnb_fused_kernel=False))
    calls = counting_update_steps(monkeypatch, type(optimizer))
    train_steps(engine, range(3))
    monkeypatch.undo()  # plain bnb: one call per parameter, whole tensors
    plain = FACTORIES[name](param_groups(reference))
    train_plain(reference, plain)
    assert_equals_plain(engine, model, reference, plain, f"{name} in pieces of {SMALL_LIMIT}")
    params = len(list(model.parameters()))
    assert max(calls) <= SMALL_LIMIT and len(calls) > 3 * params  # control: it was cut, into many pieces


def test_control_a_misplaced_split_differs_from_plain_bnb(one_rank, monkeypatch):
    """Pieces shifted by one block do not match plain bnb."""
    from deepspeed_bnb.optim import bnb_adapter
    monkeypatch.setattr(bnb_update, "MAX_UPDATE_NUMEL", SMALL_LIMIT)
    monkeypatch.setattr(bnb_adapter, "split_segment", split_one_block_early)
    model = make_model(0)
    reference = clone(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model)),
                                      config=ds_config(1, stage=2, bnb_fused_kernel=False))
    train_steps(engine, range(3))
    plain = FACTORIES["AdamW8bit"](param_groups(reference))
    train_plain(reference, plain)
    with pytest.raises(AssertionError, match="differ|state"):
        assert_equals_plain(engine, model, reference, plain, "shifted pieces")


def test_trust_ratio_on_a_parameter_cut_into_pieces_is_refused(one_rank, monkeypatch):
    monkeypatch.setattr(bnb_update, "MAX_UPDATE_NUMEL", SMALL_LIMIT)
    model = make_model(0)
    optimizer = bnb.optim.LAMB(param_groups(model), lr=1e-3, max_unorm=1.0)  # 32-bit state
    with pytest.raises(NotImplementedError, match=r"emb\.weight has 3,880 elements.*max_unorm=1\.0.*max_unorm=0"):
        deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=2))
    # control: without the trust ratio the same optimizer is accepted
    model = make_model(0)
    deepspeed.initialize(model=model, optimizer=bnb.optim.LAMB(param_groups(model), lr=1e-3, max_unorm=0.0),
                         config=ds_config(1, stage=2))
