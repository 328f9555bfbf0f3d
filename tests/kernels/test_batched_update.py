"""Small 32-bit segments share one bnb update call (deepspeed_bnb/optim/batched_update.py), only where that gives
every element the bits of its own call.

- The grouping: consecutive 32-bit segments with equal overrides and adjacent packed state join, up to the call's
  element limit; an 8-bit segment, another override, a gap in the packed state or a segment the caller refuses each
  start a run of their own.
- The probe of torch's position invariance passes for every element-wise rule here, and fails (control) when an
  update rounds an element by where it sits in the call, as a vectorized body and a scalar tail could.
- End to end, engines with batching equal plain bnb bit for bit (tests/kernels/test_matches_bnb.py and
  tests/kernels/test_update_pieces.py run with it on); tests/kernels/test_step_launches.py counts the calls it saves.
"""

import bitsandbytes.functional as F
import pytest
import torch

from deepspeed_bnb.optim import batched_update
from deepspeed_bnb.state_layout import Segment


def _segment(offset, numel, eight_bit=False, fp32_offset=0):
    return Segment(slot=0, param_start=0, numel=numel, offset=offset, eight_bit=eight_bit,
                   fp32_offset=-1 if eight_bit else fp32_offset)


def test_runs_join_adjacent_32bit_segments_of_one_override():
    segments = [_segment(0, 100, fp32_offset=0), _segment(256, 50, fp32_offset=100), _segment(512, 700, eight_bit=True),
                _segment(1280, 30, fp32_offset=150), _segment(1536, 30, fp32_offset=180),
                _segment(1792, 30, fp32_offset=300),  # a gap in the packed state
                _segment(2048, 30, fp32_offset=330), _segment(2304, 500, fp32_offset=360)]
    overrides = [{}, {}, {}, {}, {"lr": 1.0}, {"lr": 1.0}, {"lr": 1.0}, {"lr": 1.0}]
    runs = batched_update.runs(segments, overrides, lambda s, o: not s.eight_bit, limit=10_000)
    assert runs == [[0, 1], [2], [3], [4], [5, 6, 7]]
    assert batched_update.runs(segments, overrides, lambda s, o: not s.eight_bit, limit=540)[-1] == [7]
    refused = batched_update.runs(segments, overrides, lambda s, o: False, limit=10_000)
    assert refused == [[i] for i in range(len(segments))]


@pytest.mark.parametrize("rule", batched_update.ELEMENT_WISE)
def test_bnbs_32bit_cpu_update_is_position_invariant_here(rule, monkeypatch):
    monkeypatch.setattr(batched_update, "_probed", {})
    assert batched_update.position_invariant(rule)
    assert batched_update.allowed(rule, "cpu")
    assert not batched_update.allowed(rule, "cuda")  # bnb's CUDA momentum kernel rounds by index mod 4
    assert not batched_update.allowed("ademamix", "cpu")


def test_control_a_position_dependent_update_is_caught(monkeypatch):
    real = F.optimizer_update_32bit

    def by_position(name, g, p, *args, **kwargs):
        real(name, g, p, *args, **kwargs)
        if p.numel() == sum(batched_update.PROBE_SIZES):  # the concatenation only: one element nudged one ulp
            p[3] = torch.nextafter(p[3], torch.tensor(float("inf")))
    monkeypatch.setattr(F, "optimizer_update_32bit", by_position)
    monkeypatch.setattr(batched_update, "_probed", {})
    assert not batched_update.position_invariant("adam")


def test_a_probe_that_cannot_run_is_not_kept(monkeypatch):
    """Where bnb has no CPU update (0.49, or a test simulating it) nothing is batched, and the probe runs again once
    there is one."""
    monkeypatch.setattr(batched_update, "_probed", {})

    def refuses(*args, **kwargs):
        raise RuntimeError("All input tensors need to be on the same GPU")
    with monkeypatch.context() as patched:
        patched.setattr(F, "optimizer_update_32bit", refuses)
        assert not batched_update.position_invariant("adam")
    assert batched_update.position_invariant("adam")


def test_a_gradient_scale_gives_what_scaling_the_partition_first_gives():
    """adapter.step's grad_scale (DeepSpeed's unscale/clip factor, applied to a batch's joined gradient copy once and
    to a lone segment in place) steps every segment as multiplying the partition's gradient in place first does, as
    DeepSpeed's unscale_and_clip_grads would: weights and state bit for bit, for a batched run, a lone 32-bit segment
    and 8-bit ones. Control: without the scale the weights differ."""
    import bitsandbytes as bnb
    from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
    from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
    from deepspeed_bnb.state_layout import GroupLayout
    numels = (300, 40, 70, 5000, 20, 4096)  # small ones batch, 5000 and 4096 are 8-bit

    def run(mode):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in numels]
        optimizer = bnb.optim.AdamW8bit(params, lr=1e-2, min_8bit_size=4096)
        adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), 256)
        eight_bit = [adapter.eight_bit(p) for p in params]
        assert eight_bit == [n >= 4096 for n in numels]
        layout, group = GroupLayout(numels, 1), optimizer.param_groups[0]
        segments = layout.segments(0, eight_bit)
        flat = torch.zeros(layout.total_numel)
        for slot, p in zip(layout.slots, params):
            flat.narrow(0, slot.offset, slot.numel).copy_(p.detach())
        state = adapter.allocate(group, 0, segments, layout.partition_size, eight_bit, "cpu")
        scale = torch.tensor(0.37)
        for _ in range(3):
            grad = torch.randn(layout.total_numel, generator=g)
            if mode == "in place":
                for s in segments:
                    grad.narrow(0, s.offset, s.numel).mul_(scale)
            adapter.step(group, 0, flat, grad, state, segments, [{}] * len(segments),
                         grad_scale=scale if mode == "scale" else None)
        return flat, gather_param_states(layout, eight_bit, adapter.stored_classes(state), [state])

    (mine, my_states), (theirs, their_states) = run("scale"), run("in place")
    assert torch.equal(mine, theirs)
    for a, b in zip(my_states, their_states):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)
    assert not torch.equal(run("none")[0], theirs)


def test_positions_are_each_segments_elements_in_order():
    segments = [_segment(256, 5), _segment(512, 3, fp32_offset=5), _segment(1024, 1, fp32_offset=8),
                _segment(1280, 300, fp32_offset=9)]
    expected = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in segments])
    assert torch.equal(batched_update.positions(segments, "cpu"), expected)
    assert torch.equal(batched_update.positions(segments[1:2], "cpu"), torch.arange(512, 515))
