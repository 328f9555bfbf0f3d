// Stand-in for the header a CUDA build of torch generates and the CPU wheel omits; used only by
// tests/kernels/test_cuda_build.py to syntax-check csrc/cuda/adam8bit_cuda.cpp against the CPU wheel's headers.
#pragma once
#define C10_CUDA_BUILD_SHARED_LIBS
