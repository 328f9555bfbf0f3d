"""ParamState, one parameter's bnb state as a type: cut along quantization blocks it is byte for byte plain bnb's
state of the piece; cut inside a block it is requantized within half a quantization step, and counted, or refused.

The oracle is bitsandbytes itself: the same steps run by bnb on a whole parameter and, independently, on each of its
tensor-parallel slices (with the gradient's slices) give states that `split` and `join` must map onto each other bit for
bit where the slices keep every 256-element block whole (bnb quantizes each block on its own and its update is
element-wise). Controls: slices that cut blocks do not match bnb's per-slice state (so the exact cases are not
vacuous), and a requantization that keeps the old absmax breaks the half-step bound.
"""

import bitsandbytes as bnb
import pytest
import torch

from deepspeed_bnb.ops.reference import code_gap, dequantize_blockwise
from deepspeed_bnb.optim.param_state import OffBlockCut, ParamState, Requantization
from deepspeed_bnb.optim.state_classes import REGISTRY, StateClass
from support.bnb_state import ROUNDING, flat_bnb_state

OPTIMIZERS = {  # bnb classes whose update is element-wise within a block (LAMB and LARS scale by a tensor norm)
    "AdamW8bit": (lambda p: bnb.optim.AdamW8bit(p, lr=1e-2, weight_decay=0.05, min_8bit_size=0), "adam"),
    "Lion8bit": (lambda p: bnb.optim.Lion8bit(p, lr=1e-3, min_8bit_size=0), "lion"),
    "AdEMAMix8bit": (lambda p: bnb.optim.AdEMAMix8bit(p, lr=1e-2, t_alpha=5, t_beta3=5, min_8bit_size=0), "ademamix"),
    "AdamW_32bit": (lambda p: bnb.optim.AdamW(p, lr=1e-2, min_8bit_size=0), "adam"),
}
STEPS = 3


def bnb_states(name, weight, grads, slices=None):
    """bnb's own state after STEPS steps of `weight` (or of each `slices(tensor)` piece of it, with the same pieces
    of each gradient, stepped independently), as ParamStates."""
    factory, rule = OPTIMIZERS[name]
    pieces = [weight] if slices is None else slices(weight)
    params = [torch.nn.Parameter(piece.clone().contiguous()) for piece in pieces]
    optimizer = factory(params)
    for grad in grads:
        for param, piece in zip(params, [grad] if slices is None else slices(grad)):
            param.grad = piece.clone().contiguous()
        optimizer.step()
    classes = REGISTRY[rule]
    return [ParamState.of(flat_bnb_state(optimizer.state[p], p.numel()), classes) for p in params]


def same(a: ParamState, b: ParamState, label: str):
    assert a.keys() == b.keys() and a.numel == b.numel, label
    for key in a:
        if torch.is_tensor(a[key]):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{label}: {key}"
        else:
            assert a[key] == b[key], f"{label}: {key}"


def run(name, shape, seed=0):
    torch.manual_seed(seed)
    weight = torch.randn(shape)
    grads = [torch.randn(shape) * (0.5 + i) for i in range(STEPS)]
    return weight, grads


ALIGNED = [  # (shape, dim, parts): every slice's runs are whole blocks
    ((8, 1024), 0, 2), ((8, 1024), 1, 2), ((4, 512), 1, 2), ((16, 256), 0, 4), ((3, 2048), 1, 4)]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("shape,dim,parts", ALIGNED)
def test_block_aligned_slices_are_bnbs_own_state_of_each_slice(name, shape, dim, parts):
    weight, grads = run(name, shape)
    [whole] = bnb_states(name, weight, grads)
    sliced = bnb_states(name, weight, grads, lambda t: t.chunk(parts, dim))
    for p, (mine, theirs) in enumerate(zip(whole.split(shape, dim, parts), sliced)):
        same(mine, theirs, f"slice {p}")
    same(ParamState.join(sliced, shape, dim), whole, "joined")


UNEVEN = [  # (shape, dim, sizes): slices of other widths along dim (AutoTP's split of a vocabulary its size does not
    # divide), every run still whole blocks
    ((5, 512), 0, (3, 2)), ((4, 768), 1, (512, 256)), ((3, 1024), 1, (256, 512, 256))]


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW_32bit"])
@pytest.mark.parametrize("shape,dim,sizes", UNEVEN)
def test_uneven_slices_join_into_bnbs_state_of_the_whole(name, shape, dim, sizes):
    weight, grads = run(name, shape)
    [whole] = bnb_states(name, weight, grads)
    sliced = bnb_states(name, weight, grads, lambda t: t.split(sizes, dim))
    same(ParamState.join(sliced, shape, dim), whole, "joined")
    with pytest.raises(ValueError, match="cannot make a parameter"):  # slices of another parameter's widths
        ParamState.join(sliced[::-1] + sliced[:1], shape, dim)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit"])
def test_control_slices_that_cut_blocks_are_not_bnbs_state_of_each_slice(name):
    """(6, 100) in two along dimension 0: 300 elements each, the second slice starting inside block 1."""
    shape = (6, 100)
    weight, grads = run(name, shape)
    [whole] = bnb_states(name, weight, grads)
    sliced = bnb_states(name, weight, grads, lambda t: t.chunk(2, 0))
    with pytest.raises(OffBlockCut, match="inside a 256-element quantization block"):
        whole.split(shape, 0, 2)
    naive = whole.values["state1"].narrow(-1, 300, 300)  # the codes alone, read with the slice's own absmax
    assert not torch.equal(naive, sliced[1]["state1"]), "control: cutting blocks should not give bnb's slice state"


@pytest.mark.parametrize("name", ["AdamW8bit", "AdEMAMix8bit", "Lion8bit"])
@pytest.mark.parametrize("shape,dim,parts", [((6, 100), 0, 2), ((5, 300), 1, 3), ((1000,), 0, 4)])
def test_cuts_inside_blocks_are_requantized_within_half_a_step_and_counted(name, shape, dim, parts):
    weight, grads = run(name, shape)
    [whole] = bnb_states(name, weight, grads)
    report = Requantization()
    pieces = whole.split(shape, dim, parts, report)
    eight_bit_keys = [k for k, c in whole.classes.items() if c == StateClass.ELEMENT]
    rows = {k: whole[k].reshape(-1, whole.numel).shape[0] for k in eight_bit_keys}
    expected_blocks = sum(rows[k] * -(-p.numel // 256) for k in eight_bit_keys for p in pieces)
    assert report.blocks == expected_blocks and report.keys == set(eight_bit_keys)
    worst = 0.0
    for key in eight_bit_keys:  # each piece against the fp32 values it was cut from
        reference = torch.cat([whole.dequantized(key).reshape(-1, *shape).narrow(
            1 + dim, p * shape[dim] // parts, shape[dim] // parts).reshape(-1, pieces[p].numel)
            for p in range(parts)], dim=-1)
        got = torch.cat([p.dequantized(key).reshape(-1, p.numel) for p in pieces], dim=-1)
        worst = max(worst, float((got - reference).abs().max()))
        for p, piece in enumerate(pieces):
            before = reference.narrow(-1, p * piece.numel, piece.numel)
            codes = piece[key].reshape(-1, piece.numel)
            absmax = piece[whole.partner(key, StateClass.BLOCK)].reshape(codes.shape[0], -1)
            qmap = piece[whole.partner(key, StateClass.WHOLE)]
            for row, values in enumerate(before):
                error = (dequantize_blockwise(codes[row], absmax[row], qmap) - values).abs()
                bound = 0.5 * code_gap(values, absmax[row], qmap) + values.abs() * ROUNDING
                assert bool((error <= bound).all()), f"{key} row {row} of piece {p}: more than half a step"
    assert report.largest_change == pytest.approx(worst)
    assert "requantized" in str(report)


def test_control_requantizing_with_the_old_absmax_breaks_the_bound():
    shape = (6, 100)
    weight, grads = run("AdamW8bit", shape)
    [whole] = bnb_states("AdamW8bit", weight, grads)
    piece = whole.split(shape, 0, 2, Requantization())[1]
    values = whole.dequantized("state1")[300:]
    stale = whole["absmax1"].narrow(-1, 1, 2)  # the blocks the piece's elements came from, not the piece's own
    error = (dequantize_blockwise(piece["state1"], stale, piece["qmap1"]) - values).abs()
    assert bool((error > 0.5 * code_gap(values, stale, piece["qmap1"]) + 1e-12).any())


def test_32bit_state_is_cut_anywhere_exactly():
    shape = (6, 100)
    weight, grads = run("AdamW_32bit", shape)
    [whole] = bnb_states("AdamW_32bit", weight, grads)
    report = Requantization()
    pieces = whole.split(shape, 0, 2, report)
    assert report.blocks == 0 and "no block" in str(report)
    same(ParamState.join(pieces, shape, 0), whole, "joined")
    same(ParamState.concat([whole.piece(0, 77), whole.piece(77, 523)]), whole, "concat")


def test_segments_join_back_exactly_and_a_short_tail_is_allowed():
    shape = (1000,)
    weight, grads = run("AdamW8bit", shape)
    [whole] = bnb_states("AdamW8bit", weight, grads)
    same(ParamState.concat([whole.piece(0, 512), whole.piece(512, 488)]), whole, "segments")
    with pytest.raises(OffBlockCut):
        whole.piece(100, 400)


def test_pieces_that_disagree_or_do_not_fit_are_refused_by_name():
    shape = (8, 1024)
    weight, grads = run("AdamW8bit", shape)
    [whole] = bnb_states("AdamW8bit", weight, grads)
    a, b = whole.split(shape, 0, 2)
    later = ParamState({**b.values, "step": b["step"] + 1}, b.classes)
    with pytest.raises(ValueError, match="disagree on 'step'"):
        ParamState.join([a, later], shape, 0)
    other_map = ParamState({**b.values, "qmap1": b["qmap1"].flip(0)}, b.classes)
    with pytest.raises(ValueError, match="disagree on 'qmap1'"):
        ParamState.join([a, other_map], shape, 0)
    with pytest.raises(ValueError, match="dimension 1 of shape .* cannot be split into 3"):
        whole.split(shape, 1, 3)
    with pytest.raises(ValueError, match="absmax1"):
        ParamState({**whole.values, "absmax1": whole["absmax1"][:-1]}, whole.classes)
