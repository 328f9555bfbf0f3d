"""Sources and compiler flags of the operators, shared by the JIT loader and setup.py (importable without torch or
deepspeed).

Exactness depends on the flags: no FMA contraction, no fast-math, IEEE division and square root (see
ops/reference.py). Source paths are relative to the repository root.
"""

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
NVCC_FLAGS = ["-O3", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false"]
LINK_FLAGS = ["-fopenmp"]
