"""Sources and compiler flags of the operators, shared by the JIT loader and setup.py (importable without torch or
deepspeed).

Exactness depends on the flags: no FMA contraction, no fast-math, IEEE division and square root (see
ops/reference.py). Source paths are relative to the repository root.
"""

# the operators csrc/ops.cpp defines (one per update rule of ops/rules.py; tests/unit/test_rules.py holds the two equal)
OPERATORS = ("adam8bit_step_", "lion8bit_step_", "momentum8bit_step_")
CPU_SOURCES = ["csrc/ops.cpp", "csrc/cpu/adam8bit_cpu.cpp", "csrc/cpu/lion8bit_cpu.cpp",
               "csrc/cpu/momentum8bit_cpu.cpp"]
CUDA_SOURCES = ["csrc/cuda/adam8bit.cu", "csrc/cuda/adam8bit_cuda.cpp", "csrc/cuda/lion8bit.cu",
                "csrc/cuda/lion8bit_cuda.cpp", "csrc/cuda/momentum8bit.cu", "csrc/cuda/momentum8bit_cuda.cpp"]

# -fno-trapping-math: without it gcc refuses to if-convert the update loops (a select around a division or sqrt "may
# trap"), so they ran one element at a time wherever the AVX-512 path is not compiled in (~3x slower on AVX2 Zen 3).
# It changes no result: the kernels never read the FP exception flags, and rounding stays IEEE (no fast-math).
EXACT_CPU_FLAGS = ["-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fno-trapping-math"]
CPU_FLAGS = ["-O3", "-march=native", "-fopenmp"] + EXACT_CPU_FLAGS
CPU_PORTABLE_FLAGS = ["-O3", "-mavx2", "-fopenmp"] + EXACT_CPU_FLAGS
PORTABLE_ENV = "DEEPSPEED_BNB_PORTABLE"  # setup.py: "1" (any AVX2 CPU) or an x86-64 level such as x86-64-v2
X86_LEVELS = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")  # gcc's -march levels


def prebuilt_cpu_flags(portable: str = "") -> list:
    """The CPU flags of a setup.py build: this machine's CPU (""), any AVX2 CPU ("1"), or an x86-64 level."""
    if not portable:
        return CPU_FLAGS
    if portable == "1":
        return CPU_PORTABLE_FLAGS
    if portable in X86_LEVELS:
        return ["-O3", f"-march={portable}", "-fopenmp"] + EXACT_CPU_FLAGS
    raise ValueError(f"{PORTABLE_ENV}={portable!r}: expected 1 (any AVX2 CPU) or one of {', '.join(X86_LEVELS)} "
                     f"(a CPU level to build the kernels for), or unset (this machine's CPU)")
NVCC_FLAGS = ["-O3", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false"]
LINK_FLAGS = ["-fopenmp"]

# A candidate launch shape for every rule's product CUDA kernels, for a JIT build that measures it before its rule
# names it (csrc/cuda/fused_step.cuh: Tuning, DSBNB_PRODUCT_SHAPE; the GPU proof runs its parts on such a build):
# Tuning's seven arguments, e.g. "3,true,false,1,true,false,true" (blocks per SM, full-block body, index ahead, blocks
# per warp step, table-only quantizer, staged, selects). Unset: each rule's own shape.
CUDA_SHAPE_ENV = "DEEPSPEED_BNB_CUDA_SHAPE"
_SHAPE_FIELDS = (("blocks per SM", ("2", "3", "4")), ("full-block body", ("true", "false")),
                 ("index ahead", ("true", "false")), ("blocks per warp step", ("1", "2")),
                 ("table-only quantizer", ("true", "false")), ("staged", ("true", "false")),
                 ("selects", ("true", "false")))


def cuda_shape_fields(value: str) -> list:
    """The seven fields of the shape `value` names (CUDA_SHAPE_ENV's form), checked and lower-cased; [] for an empty
    value. A ValueError names the variable, the field and the values it takes."""
    if not value:
        return []
    fields = [field.strip().lower() for field in value.split(",")]
    if len(fields) != len(_SHAPE_FIELDS):
        raise ValueError(f"{CUDA_SHAPE_ENV}={value!r}: expected {len(_SHAPE_FIELDS)} comma-separated fields "
                         f"({', '.join(name for name, _ in _SHAPE_FIELDS)}), e.g. 3,true,false,1,true,false,true; "
                         f"unset it to build each rule's own shape")
    for field, (name, allowed) in zip(fields, _SHAPE_FIELDS):
        if field not in allowed:
            raise ValueError(f"{CUDA_SHAPE_ENV}={value!r}: {name} is {field!r}, expected one of {', '.join(allowed)}")
    _, full, ahead, per_step, _, staged, _ = fields
    if (per_step == "2" or staged == "true") and (full != "true" or ahead == "true" or
                                                  (per_step == "2" and staged == "true")):
        raise ValueError(f"{CUDA_SHAPE_ENV}={value!r}: two blocks per warp step and the staged loop each need the "
                         f"full-block body without the index ahead, and not each other (fused_step.cuh: Tuning)")
    return fields


def cuda_shape_flags(value: str) -> list:
    """The nvcc flags that give every rule's product kernels the shape `value` names; [] for an empty value (the
    checks: cuda_shape_fields)."""
    fields = cuda_shape_fields(value)
    # one number of seven digits (true 1, false 0): nvcc splits a -D value at its commas
    return ["-DDSBNB_CUDA_SHAPE=" + "".join({"true": "1", "false": "0"}.get(f, f) for f in fields)] if fields else []


def cuda_shape_tag(value: str) -> str:
    """A short name for the shape `value` names, for its build's folder ("" for an empty value)."""
    fields = cuda_shape_fields(value)
    return "shape" + "".join(field[0] for field in fields) if fields else ""
