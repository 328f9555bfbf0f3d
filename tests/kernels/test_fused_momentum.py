"""The fused 8-bit SGD-with-momentum step's own checks (what every rule shares, kernel and reference alike:
test_fused_rules.py; bnb's "momentum" rule is SGD8bit's).

- The semantics by hand on four fp32-state elements (exact binary fractions), reference and kernel: coupled weight
  decay, step 1 ignores the stored momentum, later steps beta1 * m + g, the update uses the new momentum, a
  non-finite gradient skips the element, the alignment padding is never touched.
- No weight-decay term without weight decay (bnb: `if weight_decay > 0`), reference and kernel: an infinite parameter
  with a zero gradient keeps a zero momentum instead of 0 * inf = NaN.
- bnb's dampening and nesterov are not used by its rule (checked on bnb itself: the same weights either way), so the
  reference ignores them too.
"""

import pytest
import torch

from deepspeed_bnb.ops import rules
from deepspeed_bnb.ops.reference import MomentumHyper
from deepspeed_bnb.state_layout import GroupLayout
from support.kernel_harness import QMAP1, needs_kernel, run_both, step_four_elements
from support.rule_cases import CASES


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
@pytest.mark.parametrize("step", [1, 2])
def test_semantics_by_hand(use_kernel, step):
    """lr 0.5, momentum 0.5, wd 0.25: every value below is exact in fp32."""
    params, momentum = step_four_elements("momentum", MomentumHyper.momentum(0.5, 0.5, 0.25, step), use_kernel)
    # g' = g + 0.25 p = [-1.25, -0.5, 2, (NaN: skipped)]; step 1: m = g'; step 2: m = 0.5 m_old + g'; p -= 0.5 m
    if step == 1:
        assert momentum == [-1.25, -0.5, 2.0, 3.0]
        assert params == [1.625, -1.75, 3.0, 8.0]
    else:
        assert momentum == [-0.75, -0.5, 1.5, 3.0]
        assert params == [1.375, -1.75, 3.25, 8.0]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
def test_no_weight_decay_term_without_weight_decay(use_kernel):
    """wd = 0 adds nothing (bnb: `if weight_decay > 0`): an infinite parameter with a zero gradient keeps a zero
    momentum instead of 0 * inf = NaN."""
    layout = GroupLayout((2,), 1)
    params = torch.zeros(layout.partition_size)
    params[:2] = torch.tensor([float("inf"), 1.0])
    momentum, grads = torch.zeros(2), torch.zeros(layout.partition_size)
    table = rules.segment_table(layout.segments(0, [False]), [0])
    hyper = rules.hyper_table([MomentumHyper.momentum(0.5, 0.5, 0.0, 2)])
    rules.step_("momentum", params, grads, [torch.zeros(0, dtype=torch.uint8)], [torch.zeros(0)], [momentum],
                [QMAP1], table, hyper, 1.0, use_kernel=use_kernel)
    assert momentum.tolist() == [0.0, 0.0] and params[:2].tolist() == [float("inf"), 1.0]


def test_bnb_ignores_dampening_and_nesterov():
    """bnb's "momentum" rule never reads dampening or nesterov (nor does the reference): same weights either way."""
    _, (plain, _, _), _, _ = run_both(CASES["momentum"], steps=3)
    _, (other, _, _), _, _ = run_both(CASES["momentum"], steps=3, dampening=0.5, nesterov=True)
    assert torch.equal(plain, other)
