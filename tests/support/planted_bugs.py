"""Bugs planted on purpose, for negative controls that more than one test runs: each must make the check it is fed
to fail."""

from deepspeed_bnb.state_layout import BLOCK_SIZE, Segment, split_segment


def split_one_block_early(segment: Segment, max_numel: int):
    """A planted bug for the controls: split_segment's pieces, each after the first starting one block early (blocks
    at the piece boundaries stepped twice, the segment's last block never)."""
    return tuple(p if p.offset == segment.offset else Segment(
        slot=p.slot, param_start=p.param_start - BLOCK_SIZE, numel=p.numel, offset=p.offset - BLOCK_SIZE,
        eight_bit=p.eight_bit, fp32_offset=p.fp32_offset - BLOCK_SIZE if p.fp32_offset >= 0 else -1)
        for p in split_segment(segment, max_numel))
