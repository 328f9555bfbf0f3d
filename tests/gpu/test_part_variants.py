"""The GPU proof's part k reads each rule's product shape off its sweep: the fastest launch shape that held bit for bit
with bitsandbytes' update, never a faster one that did not, with the --cuda-shape value and the rule's line that
name it. The sweep itself needs a GPU (tests/kernels/test_cuda_build.py compiles its variants with nvcc); this holds
the choice, on made-up sweeps.
"""

import os
import sys

from conftest import TESTS

sys.path.append(os.path.join(TESTS, "gpu"))

import part_variants  # noqa: E402
import proof_common  # noqa: E402
from deepspeed_bnb.ops.build_flags import cuda_shape_flags  # noqa: E402


def _shape(variant: int) -> str:
    return f"{2 + variant % 3},true,false,1,{'true' if variant else 'false'},false,{'true' if variant > 1 else 'false'}"


def test_the_fastest_exact_shape_is_chosen_with_its_line():
    # AdamW: variant 2 is the fastest, variant 3 faster still but not bit for bit (the control); Lion: its own shape
    # is the fastest; SGD-momentum: no shape held
    held = {(0, 0): True, (0, 1): True, (0, 2): True, (0, 3): False, (1, 0): True, (1, 1): True,
            (2, 0): False, (2, 1): False}
    shares = {(0, 0): 0.58, (0, 1): 0.64, (0, 2): 0.70, (0, 3): 0.90, (1, 0): 0.71, (1, 1): 0.59,
              (2, 0): 0.75, (2, 1): 0.78}
    shapes = {(r, v): _shape(v) for r in range(3) for v in range(4)}
    adam, lion, momentum = part_variants.fastest_exact(held, shares, shapes)
    assert adam[:4] == ("adam", 2, 0.70, 0.58)
    assert adam[4] == ("using AdamShape = DSBNB_PRODUCT_SHAPE(device::Tuning<4, true, false, 1, true, false, true>);"
                       "  // csrc/cuda/adam8bit_rules.cuh")
    assert lion[:4] == ("lion", 0, 0.71, 0.71) and "LionShape" in lion[4] and "lion8bit_rules.cuh" in lion[4]
    assert momentum == ("momentum", None, None, 0.75, None)


def test_the_made_up_shapes_are_valid_cuda_shape_values():
    # the shapes these tests feed the choice are values DEEPSPEED_BNB_CUDA_SHAPE accepts, as seven digits for nvcc
    # (the swept shapes themselves: tests/kernels/test_cuda_build.py, test_the_variants_name_the_shapes_they_compile)
    for variant in range(4):
        flags = cuda_shape_flags(_shape(variant))
        assert len(flags) == 1 and len(flags[0].split("=")[1]) == 7, flags


class _Variants:
    """What part k's table reads of the compiled variants (torch.ops.dsbnb_variants), without them."""

    def count(self):
        return 4

    def name(self, rule, variant):
        return f"rule {rule} shape {variant}"

    def shape(self, rule, variant):
        return _shape(variant)


def test_the_table_a_session_reads_names_shape_value_and_line():
    held = {(r, v): (r, v) != (2, 0) for r in range(3) for v in range(4)}
    shares = {(r, v): 0.5 + 0.05 * v for r in range(3) for v in range(4)}
    held[2, 1] = held[2, 2] = held[2, 3] = False  # SGD-momentum: nothing held
    result = proof_common.Result("k", "launch shapes", "cuda")
    part_variants.choices(_Variants(), held, shares, result)
    (table,) = result.data["tables"]
    adam, lion, momentum = table["rows"]
    assert adam[:4] == ["AdamW", "rule 0 shape 3", "65%", "50%"] and adam[4] == f"`{_shape(3)}`"
    assert "AdamShape = DSBNB_PRODUCT_SHAPE(device::Tuning<2, true, false, 1, true, false, true>)" in adam[5]
    assert lion[1] == "rule 1 shape 3" and momentum[1:3] == ["none held bit for bit", "-"]
