// fused_device.cuh — device helpers the CUDA kernels of the fused 8-bit optimizer steps share (adam8bit.cu for AdamW,
// lion8bit.cu for Lion, momentum8bit.cu for SGD with momentum): the launch shape (one warp per 256-element block, 8
// elements per lane, a persistent grid striding over the blocks of all segments), the segment lookup of a block,
// gradient loads (fp32/bf16/fp16 widened exactly), the NaN-propagating warp max, and the whole kernel of the
// one-state rules (one_state_step_kernel); master weights are read and written through dsbnb/master_weights.h. Like
// the kernels, free of torch headers (compiled by nvcc alone, see adam8bit.cu).
// Semantics: deepspeed_bnb/ops/reference.py. Test: tests/test_cuda_build.py compiles it; tests/test_fused_rules.py
// (every rule of the registry) runs it where a GPU is present.
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


// --- one-state rules (Lion, SGD-momentum): one kernel, the rule's arithmetic a template parameter --------------------
// A Rule provides `using Row` (its hyper-table row) and `__device__ static void apply(float& p, float m_old, float g,
// const Row& h, float& m_new)`: the update of one element with a finite gradient (a non-finite one keeps p and m).
// One warp per 256-element block: dequantize the momentum (qmap[code] * absmax), apply, NaN-propagating absmax by
// warp shuffles, requantize to the nearest code; fp32 segments update their packed state in place.
template <typename Rule>
__global__ void one_state_step_kernel(const Segment* __restrict__ segments, const int64_t* __restrict__ block_starts,
                                      int64_t num_segments, int64_t total_blocks,
                                      const typename Rule::Row* __restrict__ hyper,
                                      Master params, const void* __restrict__ grads, GradType grad_type,
                                      uint8_t* __restrict__ codes1, float* __restrict__ absmax1,
                                      float* __restrict__ state1, const float* __restrict__ qmap1, DeviceTables t1,
                                      const float* inv_scale) {
    __shared__ float q1[256], mid1[256];
    __shared__ uint8_t order1[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        q1[i] = qmap1[i];
        order1[i] = static_cast<uint8_t>(t1.order[i]);
        mid1[i] = t1.midpoints[i];
    }
    __syncthreads();
    const bool scale = inv_scale != nullptr;  // DeepSpeed's unscale/clip factor, read here: the host never waits
    const float factor = scale ? *inv_scale : 1.0f;
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t work = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); work < total_blocks;
         work += warps) {
        const int64_t lo = device::segment_of(block_starts, num_segments, work);
        const Segment s = segments[lo];
        const typename Rule::Row h = hyper[s.hyper_row];
        const int64_t start = (work - block_starts[lo]) * kBlock;
        const int64_t len = min(kBlock, s.numel - start);
        const int64_t base = s.offset + start;
        if (s.eight_bit) {
            const int64_t block = base / kBlock;
            const float a1 = absmax1[block];
            float m[kPerLane];
            float max1 = 0.0f;
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                const int64_t j = lane + 32 * k;
                m[k] = 0.0f;
                if (j < len) {
                    const int64_t i = base + j;
                    float g = load_grad(grads, grad_type, i);
                    if (scale) g = g * factor;
                    const float m_old = q1[codes1[i]] * a1;
                    float p = load_master(params, i);
                    if (isfinite(g)) {
                        Rule::apply(p, m_old, g, h, m[k]);
                    } else {
                        m[k] = m_old;
                    }
                    store_master(params, i, p);  // unchanged: the same bits (a NaN bf16 weight canonical)
                    max1 = nan_max(max1, fabsf(m[k]));
                }
            }
            max1 = warp_nan_max(max1);  // every lane has read absmax1[block] before lane 0 overwrites it
            const float r1 = reciprocal(max1);
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                const int64_t j = lane + 32 * k;
                if (j < len) {
                    codes1[base + j] = order1[nearest_sorted(normalize(m[k], r1), mid1, t1.lut, t1.max_walk)];
                }
            }
            if (lane == 0) absmax1[block] = max1;
        } else {
            for (int k = 0; k < kPerLane; ++k) {
                const int64_t j = lane + 32 * k;
                if (j >= len) continue;
                const int64_t i = base + j;
                const int64_t f = s.fp32_offset + start + j;
                float g = load_grad(grads, grad_type, i);
                if (scale) g = g * factor;
                float p = load_master(params, i);
                if (isfinite(g)) {
                    float m_new;
                    Rule::apply(p, state1[f], g, h, m_new);
                    state1[f] = m_new;
                }
                store_master(params, i, p);
            }
        }
    }
}

// Launch of a one-state kernel on `stream` (persistent grid, grid-stride); returns the CUDA error code (0: none).
template <typename Rule>
int launch_one_state_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                          int64_t total_blocks, const typename Rule::Row* hyper, Master params, const void* grads,
                          GradType grad_type, uint8_t* codes1, float* absmax1, float* state1, const float* qmap1,
                          DeviceTables tables1, const float* inv_scale, void* stream) {
    if (total_blocks == 0) return 0;
    one_state_step_kernel<Rule><<<grid_for(total_blocks), 32 * kWarpsPerBlock, 0,
                                   static_cast<cudaStream_t>(stream)>>>(
        segments, block_starts, num_segments, total_blocks, hyper, params, grads, grad_type, codes1, absmax1, state1,
        qmap1, tables1, inv_scale);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace device
}  // namespace dsbnb
