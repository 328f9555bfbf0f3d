"""The CUDA kernels compile here, without a GPU: nvcc builds every kernel of build_flags.CUDA_SOURCES (csrc/cuda/*.cu)
for sm_80 and sm_90, and their torch bindings (csrc/cuda/*_cuda.cpp) pass a syntax check against this torch's headers
(the CPU wheel lacks one generated CUDA header, supplied by tests/cuda_shim). Running the kernels needs a GPU:
tests/kernels/test_fused_rules.py does it for every rule where one is present. Every CUDA source is one or the other
(test_every_cuda_source_is_checked); every rule has its CUDA implementation there (tests/unit/test_rules.py)."""

import json
import os
import sys

import pytest

from conftest import without_launch_vars
from support import background
from support.cuda_compiles import BINDINGS, KERNELS
from deepspeed_bnb.ops.build_flags import CUDA_SOURCES

pytestmark = pytest.mark.slow
# every compile in one fresh process (tests/support/cuda_compiles.py), run beside the earlier tests; the timeout only
# ends a hang
COMPILES = background.Job("cuda_compiles", lambda folder: [
    sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "cuda_compiles.py"), folder],
    without_launch_vars, timeout=1800)
BACKGROUND_JOBS = (COMPILES,)


def test_every_cuda_source_is_checked():
    """Each CUDA source is compiled by nvcc (a kernel) or syntax-checked (a binding), in csrc/cuda; and there are
    some (control: an empty list would pass every parametrized test below vacuously)."""
    assert KERNELS and BINDINGS
    assert sorted(CUDA_SOURCES) == sorted([f"csrc/cuda/{k}.cu" for k in KERNELS] +
                                          [f"csrc/cuda/{b}.cpp" for b in BINDINGS])


@pytest.fixture(scope="module")
def cuda_compiles():
    """name -> (return code, stderr, the objects' folder) of every compile (support/cuda_compiles.py)."""
    done = background.result(COMPILES)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with open(os.path.join(done.folder, "results.json")) as f:
        results = json.load(f)
    if "skip" in results:
        pytest.skip(results["skip"])
    return {name: (code, stderr, done.folder) for name, (code, stderr) in results.items()}


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_sm80_and_sm90(cuda_compiles, kernel):
    returncode, stderr, out_dir = cuda_compiles[kernel]
    assert returncode == 0, stderr[-4000:]
    assert os.path.getsize(os.path.join(out_dir, f"{kernel}.o")) > 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_with_a_candidate_shape(cuda_compiles, kernel):
    """DEEPSPEED_BNB_CUDA_SHAPE's build (the GPU proof measures a candidate shape of the product's kernels so): every
    rule's kernels compile with the shape given on the command line, and it is that shape they compile."""
    returncode, stderr, out_dir = cuda_compiles[f"{kernel}_candidate_shape"]
    assert returncode == 0, stderr[-4000:]
    with open(os.path.join(out_dir, f"{kernel}_candidate_shape.o"), "rb") as f:
        compiled = f.read()
    with open(os.path.join(out_dir, f"{kernel}.o"), "rb") as f:
        product = f.read()
    # the kernels' mangled names carry the shape: Tuning<3, true, false, 1, true, false, true> there, not in the
    # product's own build (control)
    candidate = b"TuningILi3ELb1ELb0ELi1ELb1ELb0ELb1E"
    assert candidate in compiled and candidate not in product


@pytest.mark.parametrize("binding", BINDINGS)
def test_binding_syntax(cuda_compiles, binding):
    returncode, stderr, _ = cuda_compiles[binding]
    assert returncode == 0, stderr[-4000:]


def test_the_launch_shape_variants_compile(cuda_compiles):
    """The GPU proof's part k builds these on the device: every shape of every rule compiles for sm_90 (the H100 and
    H200 it runs on), and the binding against this torch's headers."""
    for name in ("kernel_variants", "kernel_variants_binding"):
        returncode, stderr, _ = cuda_compiles[name]
        assert returncode == 0, f"{name}: {stderr[-4000:]}"


def _described(fields: list) -> str:
    """The part's description of a shape from its seven fields (kernel_variants.cu: describe)."""
    blocks, full, ahead, per_step, table_only, staged, selects = fields
    parts = [f"{blocks} blocks/SM"] + [text for on, text in (
        (full == "true", "full-block body"), (ahead == "true", "index ahead"),
        (per_step == "2", "2 blocks per warp step"), (table_only == "true", "table-only quantizer"),
        (staged == "true", "staged in shared memory"), (selects == "true", "selects")) if on]
    return ", ".join(parts)


def test_the_variants_name_the_shapes_they_compile(cuda_compiles):
    """Part k's table offers each shape's Tuning arguments (--cuda-shape, the rule's line): for every rule and
    variant they are a value DEEPSPEED_BNB_CUDA_SHAPE accepts and say what the variant's description says; variant 0
    is the rule's own; the sweep has no shape twice and holds the candidate the proof measures as the product."""
    from deepspeed_bnb.ops.build_flags import cuda_shape_fields
    from support.cuda_compiles import CANDIDATE_SHAPE
    returncode, listing, _ = cuda_compiles["kernel_variants_shapes"]
    assert returncode == 0, listing[-4000:]
    rows = [line.split(" ", 3) for line in listing.splitlines()]
    assert len(rows) >= 3 * 2 and {r for r, *_ in rows} == {"0", "1", "2"}, listing
    for rule, variant, shape, name in rows:
        fields = cuda_shape_fields(shape)
        assert name == ("product: " if variant == "0" else "") + _described(fields), (rule, variant, shape, name)
    for rule in "012":
        swept = [shape for r, variant, shape, _ in rows if r == rule and variant != "0"]
        assert len(swept) == len(set(swept)) and CANDIDATE_SHAPE in swept, swept
