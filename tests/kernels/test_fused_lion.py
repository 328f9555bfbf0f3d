"""The fused 8-bit Lion step's own checks (what every rule shares, kernel and reference alike: test_fused_rules.py).

- The semantics by hand on four fp32-state elements (exact binary fractions), reference and kernel: decoupled decay
  before the step, the direction from the old momentum, sign(0) = 0, a non-finite gradient skips the element, the
  alignment padding is never touched.
"""

import pytest

from deepspeed_bnb.ops.reference import LionHyper
from support.kernel_harness import needs_kernel, step_four_elements


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["reference", "kernel"])
def test_semantics_by_hand(use_kernel):
    """lr 0.5, wd 0.25 (decay 0.875), beta1 0.5, beta2 0.75: every value below is exact in fp32."""
    params, momentum = step_four_elements("lion", LionHyper.lion(0.5, 0.5, 0.75, 0.25), use_kernel)
    # 0: direction 0.5 - 0.75 < 0 from the *old* momentum (the new one, 0.375, is positive): 0.875 + 0.5
    # 1: direction 0, sign 0: decay only; 2: direction -0.5 + 0.5 = 0: decay only; 3: NaN gradient: untouched
    assert params == [1.375, -1.75, 3.5, 8.0]
    assert momentum == [0.375, 0.0, -0.5, 3.0]
