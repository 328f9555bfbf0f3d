"""Block-aligned layout math (pure, no torch.distributed): blocks never straddle parameters or ranks."""

import random

import pytest

from deepspeed_bnb.state_layout import BLOCK_SIZE, GroupLayout, ShardedLayout, layout_from_dict, num_blocks, \
    uses_8bit_state


def random_numels(rng, count):
    return tuple(rng.choice([1, 97, 255, 256, 257, 1000, 4095, 4096, 12040, 70001]) for _ in range(count))


@pytest.mark.parametrize("seed", range(20))
def test_segments_tile_every_parameter_once_on_block_boundaries(seed):
    rng = random.Random(seed)
    numels = random_numels(rng, rng.randint(1, 9))
    eight_bit = [uses_8bit_state(n, 8, 1000) for n in numels]
    for dp in (1, 2, 3, 4, 7):
        layout = GroupLayout(numels, dp)
        assert layout.total_numel % (BLOCK_SIZE * dp) == 0
        assert layout.partition_size * dp == layout.total_numel
        assert all(slot.offset % BLOCK_SIZE == 0 for slot in layout.slots)
        covered = [0] * len(numels)
        for rank in range(dp):
            fp32_end = 0
            for seg in layout.segments(rank, eight_bit):
                slot = layout.slots[seg.slot]
                assert seg.offset % BLOCK_SIZE == 0 and seg.param_start % BLOCK_SIZE == 0
                assert rank * layout.partition_size + seg.offset == slot.offset + seg.param_start
                assert seg.param_start == covered[seg.slot]  # pieces arrive in order, without gaps
                covered[seg.slot] += seg.numel
                assert seg.offset + seg.numel <= layout.partition_size
                if not seg.eight_bit:
                    assert seg.fp32_offset == fp32_end
                    fp32_end += seg.numel
            used = sum(s.numel for s in layout.segments(rank, eight_bit))
            assert used + layout.tail_padding(rank) <= layout.partition_size
        assert covered == list(numels)


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_parameter_blocks_do_not_depend_on_dp(dp):
    """The state of a parameter is a function of the model: its blocks are counted from its own first element."""
    numels = (3880, 12040, 301, 11137, 97)
    layout = GroupLayout(numels, dp)
    for slot, numel in zip(layout.slots[:-1], numels):
        assert slot.numel == numel and (slot.offset + slot.numel + slot.padding) % BLOCK_SIZE == 0
    blocks = {}
    for rank in range(dp):
        for seg in layout.segments(rank, [True] * len(numels)):
            blocks.setdefault(seg.slot, 0)
            blocks[seg.slot] += seg.blocks
    assert [blocks[i] for i in range(len(numels))] == [num_blocks(n) for n in numels]


def test_padding_overhead_is_below_one_block_per_parameter():
    numels = tuple(range(1, 200, 7))
    for dp in (1, 8, 64):
        layout = GroupLayout(numels, dp)
        assert layout.padding_numel < BLOCK_SIZE * (len(numels) + dp)


def test_precision_rule_is_bnb_rule_on_the_whole_parameter():
    assert uses_8bit_state(4096, 8, 4096) and not uses_8bit_state(4095, 8, 4096)
    assert not uses_8bit_state(10**6, 32, 4096)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="dp must be"):
        GroupLayout((10,), 0)
    with pytest.raises(ValueError, match="at least one element"):
        GroupLayout((10, 0), 2)
    with pytest.raises(ValueError, match="rank 2 outside"):
        GroupLayout((10,), 2).segments(2, [True])


# ---- ZeRO-3: each parameter partitioned on its own ------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_sharded_segments_tile_every_parameter_once_on_block_boundaries(seed):
    rng = random.Random(seed)
    numels = random_numels(rng, rng.randint(1, 9))
    eight_bit = [uses_8bit_state(n, 8, 1000) for n in numels]
    for dp in (1, 2, 3, 4, 7, 64):
        layout = ShardedLayout(numels, dp)
        covered = [0] * len(numels)
        for rank in range(dp):
            fp32_end = 0
            for seg in layout.segments(rank, eight_bit):
                assert seg.offset % BLOCK_SIZE == 0 and seg.param_start % BLOCK_SIZE == 0
                assert seg.offset == layout.offsets[seg.slot]  # a slice sits at the same place on every rank
                assert seg.param_start == rank * layout.slice_numel(seg.slot) == covered[seg.slot]
                covered[seg.slot] += seg.numel
                assert seg.numel <= layout.slice_numel(seg.slot) and seg.offset + seg.numel <= layout.partition_size
                if not seg.eight_bit:
                    assert seg.fp32_offset == fp32_end
                    fp32_end += seg.numel
        assert covered == list(numels)
        assert layout.partition_size * dp == layout.total_numel == sum(numels) + layout.padding_numel


def test_sharded_small_parameters_leave_ranks_empty_handed():
    layout = ShardedLayout((97, 300, 70001), dp=4)
    owned = {rank: {s.slot: s.numel for s in layout.segments(rank, [True] * 3)} for rank in range(4)}
    assert owned[0][0] == 97 and all(0 not in owned[r] for r in (1, 2, 3))  # one block: rank 0 alone
    assert (owned[0][1], owned[1][1]) == (256, 44) and 1 not in owned[2] and 1 not in owned[3]
    assert sum(owned[r][2] for r in range(4)) == 70001


def test_sharded_stock_slices_are_deepspeeds():
    # block=1 describes stock ZeRO-3: the slices DeepSpeed's zero_to_fp32 expects (ceil(numel / dp) per rank)
    from deepspeed.utils.zero_to_fp32 import zero3_partitioned_param_info
    numels = (1, 97, 255, 4097, 12040)
    for dp in (1, 2, 3, 4, 7):
        stock = ShardedLayout(numels, dp, block=1)
        assert [stock.slice_numel(j) for j in range(len(numels))] == \
            [zero3_partitioned_param_info(n, dp)[0] for n in numels]


def test_sharded_index_arithmetic_past_2_to_the_31():
    # bnb passes `n` as int32; a ZeRO-3 sub-group of several such parameters is far beyond it: the segment table
    # (offsets, starts, lengths) is exact Python-integer arithmetic, checked here without allocating anything
    big = 3 * 2 ** 31 + 7
    layout = ShardedLayout((big, 97, big), dp=2)
    segments = {rank: layout.segments(rank, [True, True, True]) for rank in range(2)}
    assert layout.partition_size > 2 ** 32
    assert sum(s.numel for r in segments for s in segments[r] if s.slot == 2) == big
    last = segments[1][-1]
    assert last.slot == 2 and last.param_start == layout.slice_numel(2) > 2 ** 31
    assert last.offset == layout.slice_numel(0) + layout.slice_numel(1) and last.first_block == last.offset // 256


def test_sharded_layout_round_trips_and_flat_one_stays_format_one():
    sharded, flat = ShardedLayout((97, 4096), 3), GroupLayout((97, 4096), 3)
    assert layout_from_dict(sharded.to_dict()) == sharded and "kind" in sharded.to_dict()
    assert layout_from_dict(flat.to_dict()) == flat and "kind" not in flat.to_dict()  # files of format 1 unchanged
    with pytest.raises(ValueError, match="dp and block"):
        ShardedLayout((10,), 0)
