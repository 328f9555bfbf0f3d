// fused_device.cuh — device helpers the CUDA kernels of the fused 8-bit optimizer steps share (adam8bit.cu for AdamW,
// lion8bit.cu for Lion, momentum8bit.cu for SGD with momentum): the launch shape (one warp per 256-element block, 8
// elements per lane, a persistent grid striding over the blocks of all segments), the segment lookup of a block,
// gradient loads (fp32/bf16/fp16 widened exactly), the bf16/fp16 parameter copy (c10's rounding and NaN), and the
// NaN-propagating warp max. Like the kernels, free of torch headers (compiled by nvcc alone, see adam8bit.cu).
// Semantics: deepspeed_bnb/ops/reference.py. Test: tests/test_cuda_build.py compiles it; tests/test_fused_step.py,
// test_fused_lion.py and test_fused_momentum.py run it where a GPU is present.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "adam8bit_launch.h"

namespace dsbnb {
namespace device {

constexpr int kWarpsPerBlock = 8;
constexpr int kPerLane = kBlock / 32;

__device__ __forceinline__ float load_grad(const void* grads, GradType type, int64_t i) {
    switch (type) {
        case GradType::kBFloat16: {
            const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(grads)[i]) << 16;
            return __uint_as_float(bits);
        }
        case GradType::kFloat16: return __half2float(static_cast<const __half*>(grads)[i]);
        default: return static_cast<const float*>(grads)[i];
    }
}

__device__ __forceinline__ void store_low(void* low, LowType type, int64_t i, float p) {
    if (type == LowType::kBFloat16) {
        static_cast<uint16_t*>(low)[i] = bf16_bits(p);
    } else if (type == LowType::kFloat16) {
        static_cast<__half*>(low)[i] = (p != p) ? __ushort_as_half(0x7E00) : __float2half_rn(p);  // c10's NaN
    }
}

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

__device__ __forceinline__ float warp_nan_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = nan_max(x, __shfl_xor_sync(0xFFFFFFFFu, x, offset));
    return x;
}

// The segment holding global block `work`: the last segment whose first block (block_starts, prefix sums of each
// segment's blocks) is <= work.
__device__ __forceinline__ int64_t segment_of(const int64_t* __restrict__ block_starts, int64_t num_segments,
                                              int64_t work) {
    int64_t lo = 0, hi = num_segments;
    while (hi - lo > 1) {
        const int64_t middle = (lo + hi) / 2;
        if (block_starts[middle] <= work) lo = middle; else hi = middle;
    }
    return lo;
}

// Thread blocks for `total_blocks` warps of work on the current device: enough for all of them, at most 8 per SM
// (the kernels stride over the rest).
inline int grid_for(int64_t total_blocks) {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    const int64_t needed = (total_blocks + kWarpsPerBlock - 1) / kWarpsPerBlock;
    return static_cast<int>(needed < 8LL * sms ? needed : 8LL * sms);
}

}  // namespace device
}  // namespace dsbnb
