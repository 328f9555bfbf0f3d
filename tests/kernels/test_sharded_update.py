"""A sharded update of a flat buffer is bit-identical to the unsharded one (single process, no communication).

Every bnb optimizer runs on the block-aligned layout at DP=1 and at DP=3 (one partition per simulated rank, a
parameter larger than a partition, one smaller than a block), given the same gradients; per-parameter state and
weights must be byte-equal. The same holds for ZeRO-3's layout (each parameter split on its own into block-aligned
slices) at DP=4, where ranks own nothing of the small parameters. Control: sharding the way stock ZeRO does
(contiguous parameters, bnb on each raw partition) does change the result, so the comparison can fail.
"""

import pytest
import torch

from support.bnb_optimizers import FACTORIES
from support.bnb_state import assert_same
from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
from deepspeed_bnb.state_layout import GroupLayout, ShardedLayout

NUMELS = (3880, 12040, 301, 11137, 97)
STEPS = 4


def initial_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g) * 0.1) for n in NUMELS]


def gradients(step):
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(n, generator=g) for n in NUMELS]
    grads[3][:300] = 0.0  # a stretch of zero gradient inside a parameter
    return grads


def run_block_aligned(factory, dp):
    params = initial_params()
    optimizer = factory(params)
    adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), 256)
    layout = GroupLayout(NUMELS, dp)
    eight_bit = [adapter.eight_bit(p) for p in params]
    group, size = optimizer.param_groups[0], layout.partition_size
    flat = torch.zeros(layout.total_numel)
    for slot, p in zip(layout.slots, params):
        flat.narrow(0, slot.offset, slot.numel).copy_(p.detach())
    tables = [layout.segments(rank, eight_bit) for rank in range(dp)]
    states = [adapter.allocate(group, 0, tables[r], size, eight_bit, "cpu") for r in range(dp)]
    for step in range(STEPS):
        flat_grad = torch.zeros_like(flat)
        for slot, grad in zip(layout.slots, gradients(step)):
            flat_grad.narrow(0, slot.offset, slot.numel).copy_(grad)
        for rank in range(dp):
            adapter.step(group, 0, flat.narrow(0, rank * size, size), flat_grad.narrow(0, rank * size, size),
                         states[rank], tables[rank], [adapter.override(params[s.slot]) for s in tables[rank]])
    classes = adapter.stored_classes(states[0])  # every rank holds the same keys
    weights = [flat.narrow(0, s.offset, s.numel).clone() for s in layout.slots]
    padding = torch.cat([flat.narrow(0, s.offset + s.numel, s.padding) for s in layout.slots]
                        + [flat.narrow(0, layout.used_numel, layout.total_numel - layout.used_numel)])
    return weights, gather_param_states(layout, eight_bit, classes, states), padding


def run_sharded(factory, dp):
    """ZeRO-3's layout: rank r holds slice r of every parameter, the slices side by side in its partition."""
    params = initial_params()
    optimizer = factory(params)
    adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), 256)
    layout = ShardedLayout(NUMELS, dp)
    eight_bit = [adapter.eight_bit(p) for p in params]
    group, size = optimizer.param_groups[0], layout.partition_size
    tables = [layout.segments(rank, eight_bit) for rank in range(dp)]

    def partitions(full):
        parts = [torch.zeros(size) for _ in range(dp)]
        for rank in range(dp):
            for seg in tables[rank]:
                parts[rank].narrow(0, seg.offset, seg.numel).copy_(full[seg.slot].narrow(0, seg.param_start,
                                                                                           seg.numel))
        return parts

    flats = partitions([p.detach() for p in params])
    states = [adapter.allocate(group, 0, tables[r], size, eight_bit, "cpu") for r in range(dp)]
    for step in range(STEPS):
        grads = partitions(gradients(step))
        for rank in range(dp):
            adapter.step(group, 0, flats[rank], grads[rank], states[rank], tables[rank],
                         [adapter.override(params[s.slot]) for s in tables[rank]])
    pieces = {}
    for rank in range(dp):
        for seg in tables[rank]:
            pieces.setdefault(seg.slot, []).append(flats[rank].narrow(0, seg.offset, seg.numel))
    weights = [torch.cat(pieces[j]) for j in range(len(NUMELS))]
    empty = sum(1 for rank in range(dp) for j in range(len(NUMELS)) if j not in {s.slot for s in tables[rank]})
    return weights, gather_param_states(layout, eight_bit, adapter.stored_classes(states[0]), states), empty


def run_stock_sharding(factory, dp):
    """bnb stepping each rank's raw slice of a contiguous flat buffer, as under stock ZeRO."""
    total = sum(NUMELS)
    size = -(-total // (2 * dp)) * 2
    flat = torch.zeros(size * dp)
    flat[:total] = torch.cat([p.detach() for p in initial_params()])
    parts = [torch.nn.Parameter(flat[r * size:(r + 1) * size].clone()) for r in range(dp)]
    optimizer = factory(parts)
    for step in range(STEPS):
        grad = torch.zeros_like(flat)
        grad[:total] = torch.cat(gradients(step))
        for r, part in enumerate(parts):
            part.grad = grad[r * size:(r + 1) * size].clone()
        optimizer.step()
    joined = torch.cat([p.detach() for p in parts])
    return list(torch.split(joined[:total], NUMELS))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_sharded_equals_unsharded(name):
    weights1, states1, _ = run_block_aligned(FACTORIES[name], dp=1)
    weights3, states3, padding = run_block_aligned(FACTORIES[name], dp=3)
    for w1, w3 in zip(weights1, weights3):
        assert torch.equal(w1, w3)
    assert len(states1) == len(states3)
    for s1, s3 in zip(states1, states3):
        assert_same(s1, s3, "dp 3")
    assert not padding.any(), "alignment padding must stay exactly zero"
    assert any(not torch.equal(w, p.detach()) for w, p in zip(weights1, initial_params()))  # it moved


# LAMB and LARS scale an fp32-state parameter's update by its whole-tensor norm ratio; ZeRO-3 splits every parameter
# across the ranks, so BnbZeroStage3Optimizer refuses them at DP > 1 (here they would differ: 301 elements at DP=4)
TRUST_RATIO = ("LAMB8bit", "LARS8bit")


@pytest.mark.parametrize("name", sorted(set(FACTORIES) - set(TRUST_RATIO)))
def test_zero3_sharded_equals_unsharded(name):
    weights1, states1, _ = run_block_aligned(FACTORIES[name], dp=1)
    weights4, states4, empty = run_sharded(FACTORIES[name], dp=4)
    assert empty >= 3  # ranks 1-3 own nothing of the 97-element parameter
    for w1, w4 in zip(weights1, weights4):
        assert torch.equal(w1, w4)
    assert len(states1) == len(states4)
    for s1, s4 in zip(states1, states4):
        assert_same(s1, s4, "dp 4")


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit"])
def test_control_stock_sharding_changes_result(name):
    weights1, _, _ = run_block_aligned(FACTORIES[name], dp=1)
    stock = run_stock_sharding(FACTORIES[name], dp=3)
    assert any(not torch.equal(a, b) for a, b in zip(weights1, stock))
