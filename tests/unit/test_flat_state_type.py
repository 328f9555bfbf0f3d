"""FlatKeys, a rank's flat partition state as a type: bnb's own per-parameter state written into the flat states of
several ranks and read back per segment is bnb's state again, bit for bit; what a rank saves, ZeRO-3's joins and cuts
of sub-groups, and zero storage follow the keys' classes.

The oracle is bitsandbytes itself: a param group of 8-bit and 32-bit-state parameters (sizes off block boundaries)
stepped by a plain bnb optimizer. Controls: a flat state whose pieces are written at each other's places does not read
back as bnb's state, and a rank other than 0 saves no quantization map.
"""

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.checkpoint.format.param_state import gather_param_states, scatter_param_states
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.optim.flat_state import bnb_name, stored_name
from deepspeed_bnb.optim.param_state import ParamState, Requantization
from deepspeed_bnb.optim.state_classes import REGISTRY, StateClass
from deepspeed_bnb.state_layout import BLOCK_SIZE, GroupLayout, ShardedLayout
from support.bnb_state import flat_bnb_state

SIZES = (1000, 300, 4096, 7, 2500)  # 8-bit above min_8bit_size (1000 and more), 32-bit state below it
MIN_8BIT = 1000


def bnb_run(factory, steps=3, seed=0):
    """A plain bnb optimizer stepped over parameters of SIZES; (optimizer, params, precisions)."""
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n)) for n in SIZES]
    optimizer = factory(params)
    for i in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * (1 + i)
        optimizer.step()
    eight_bit = [optimizer.state[p]["state1"].dtype == torch.uint8 for p in params]
    assert eight_bit == [n >= MIN_8BIT for n in SIZES]  # both precisions in the group: the test is not one-sided
    return optimizer, params, eight_bit


def flat_keys(optimizer, eight_bit):
    """The flat keys and templates a live partition of this group holds (what the engine's adapter probes)."""
    adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), BLOCK_SIZE)
    return adapter.flat_keys(optimizer.param_groups[0], 0, eight_bit, "cpu")


FACTORIES = {
    "AdamW8bit": (lambda p: bnb.optim.AdamW8bit(p, lr=1e-2, min_8bit_size=MIN_8BIT), "adam"),
    "Lion8bit": (lambda p: bnb.optim.Lion8bit(p, lr=1e-3, min_8bit_size=MIN_8BIT), "lion"),
    "AdEMAMix8bit": (lambda p: bnb.optim.AdEMAMix8bit(p, lr=1e-2, t_alpha=5, t_beta3=5, min_8bit_size=MIN_8BIT),
                     "ademamix"),
}


def rank_states(keys, templates, layout, eight_bit, per_param):
    states = []
    for rank in range(layout.dp):
        state = keys.zeros(templates, layout.partition_size, layout.fp32_numel(rank, eight_bit))
        scatter_param_states(layout, eight_bit, keys, per_param, rank, state)
        states.append(state)
    return states


@pytest.mark.parametrize("name", FACTORIES)
@pytest.mark.parametrize("layout_class,dp", [(GroupLayout, 1), (GroupLayout, 3), (ShardedLayout, 2)])
def test_bnbs_state_written_into_ranks_reads_back_bit_for_bit(name, layout_class, dp):
    factory, rule = FACTORIES[name]
    optimizer, params, eight_bit = bnb_run(factory)
    keys, templates = flat_keys(optimizer, eight_bit)
    plain = [ParamState.of(flat_bnb_state(optimizer.state[p], p.numel()), REGISTRY[rule]) for p in params]
    layout = layout_class(SIZES, dp)
    states = rank_states(keys, templates, layout, eight_bit, plain)
    for i, (mine, theirs) in enumerate(zip(gather_param_states(layout, eight_bit, keys, states), plain)):
        assert mine.keys() == theirs.keys() == keys.held(eight_bit[i]), i
        for key in theirs:
            if torch.is_tensor(theirs[key]):
                assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), (i, key)
            else:
                assert mine[key] == theirs[key], (i, key)


def test_control_pieces_written_at_each_others_places_do_not_read_back():
    optimizer, params, eight_bit = bnb_run(FACTORIES["AdamW8bit"][0])
    keys, templates = flat_keys(optimizer, eight_bit)
    plain = [ParamState.of(flat_bnb_state(optimizer.state[p], p.numel()), REGISTRY["adam"]) for p in params]
    layout = GroupLayout(SIZES, 1)
    [state] = rank_states(keys, templates, layout, eight_bit, plain)
    first, second = [s for s in layout.segments(0, eight_bit) if s.eight_bit][:2]  # 1000 and 4096 elements
    other = plain[second.slot].piece(0, first.numel, Requantization())  # the other parameter's state, fitted
    keys.write(state, first, other)
    back = keys.param_state(state, first)
    assert not torch.equal(back["state1"], plain[first.slot]["state1"])


def test_views_write_through_and_cover_only_their_segment():
    optimizer, params, eight_bit = bnb_run(FACTORIES["AdamW8bit"][0])
    keys, templates = flat_keys(optimizer, eight_bit)
    layout = GroupLayout(SIZES, 2)
    state = keys.zeros(templates, layout.partition_size, layout.fp32_numel(1, eight_bit))
    segments = layout.segments(1, eight_bit)
    for seg in segments:
        views = keys.views(state, seg)
        assert set(views) == keys.held(seg.eight_bit)
        views["state1"].fill_(seg.slot + 1)  # bnb's update writes its state through these views
    for seg in segments:
        key = "state1" if seg.eight_bit else stored_name("state1", StateClass.ELEMENT, False)
        start = seg.offset if seg.eight_bit else seg.fp32_offset
        assert bool((state[key][start:start + seg.numel] == seg.slot + 1).all()), seg
    written = sum(s.numel for s in segments if s.eight_bit)
    assert int((state["state1"] != 0).sum()) == written  # padding and other ranks' places untouched


def test_a_rank_saves_the_maps_only_on_rank_0_and_zero_storage_follows_the_partition():
    optimizer, params, eight_bit = bnb_run(FACTORIES["AdamW8bit"][0])
    keys, templates = flat_keys(optimizer, eight_bit)
    state = keys.zeros(templates, 512, 300)
    assert state["state1"].shape == (512,) and state["absmax1"].shape == (2,)
    assert state[stored_name("state1", StateClass.ELEMENT, False)].shape == (300,)
    assert keys.length("absmax2", 512, 300) == 2 and keys.length("qmap1", 512, 300) is None
    assert set(keys.saved_by(state, 0)) == set(keys)
    assert set(keys.saved_by(state, 1)) == set(keys) - {"qmap1", "qmap2"}
    assert set(keys.whole(state)) == {"qmap1", "qmap2"}
    assert all(bnb_name(stored_name(k, c, False)) == k for k, c in REGISTRY["adam"].items())


def test_zero3_sub_groups_join_and_cut_back_exactly():
    optimizer, params, eight_bit = bnb_run(FACTORIES["AdamW8bit"][0])
    keys, templates = flat_keys(optimizer, eight_bit)
    plain = [ParamState.of(flat_bnb_state(optimizer.state[p], p.numel()), REGISTRY["adam"]) for p in params]
    cut = 2  # sub-groups: parameters [0, 2) and [2, 5)
    subs, sizes = [], []
    for lo, hi in ((0, cut), (cut, len(SIZES))):
        layout = ShardedLayout(SIZES[lo:hi], 1)
        [state] = rank_states(keys, templates, layout, eight_bit[lo:hi], plain[lo:hi])
        subs.append(state)
        sizes.append((layout.partition_size, layout.fp32_numel(0, eight_bit[lo:hi])))
    joined = keys.join(subs)
    assert joined["state1"].shape[-1] == sum(s for s, _ in sizes)
    back = gather_param_states(ShardedLayout(SIZES, 1), eight_bit, keys, [joined])
    assert all(torch.equal(b["state2"], p["state2"]) for b, p in zip(back, plain))
    fresh = [keys.zeros(templates, s, f) for s, f in sizes]
    offset = fp32_offset = 0
    for live, (size, fp32_size) in zip(fresh, sizes):
        keys.cut_into(live, joined, offset, size, fp32_offset, fp32_size)
        offset, fp32_offset = offset + size, fp32_offset + fp32_size
    for live, sub in zip(fresh, subs):
        assert live.keys() == sub.keys()
        for key in sub:
            assert torch.equal(live[key], sub[key]) if torch.is_tensor(sub[key]) else live[key] == sub[key], key
    alone = keys.join(subs[:1])  # one sub-group: its own tensors, loaded in place
    assert all(alone[k] is subs[0][k] for k in alone)
