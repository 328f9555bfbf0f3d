// momentum8bit.cu — the CUDA kernel of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-momentum step
// (bitsandbytes' "momentum" rule) over a whole ZeRO partition. Same shape as the Lion kernel (lion8bit.cu): one warp
// per 256-element block (8 elements per lane, coalesced), grid-stride over the blocks of all segments, map and
// midpoints in shared memory, NaN-propagating absmax by warp shuffles, 64-bit indexing, one state (the momentum).
//
// Semantics: deepspeed_bnb/ops/reference.py (momentum8bit_step), bit for bit; the per-element arithmetic
// (dsbnb::momentum_state, momentum_param) is shared with the CPU kernel through csrc/include/dsbnb/adam8bit.h, the
// launch shape and device helpers with the other kernels through fused_device.cuh. References: bitsandbytes 0.50.2
// csrc/kernels.cu (kOptimizerStatic8bit1StateBlockwise and kOptimizer32bit1State, MOMENTUM).
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding
// (momentum8bit_cuda.cpp). It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/momentum8bit.cu -o /tmp/momentum8bit.o
// Flags that keep it exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/test_fused_momentum.py (runs its CUDA cases where a GPU is present); tests/test_cuda_build.py.

#include "fused_device.cuh"

namespace dsbnb {
namespace {

using device::kPerLane;
using device::kWarpsPerBlock;
using device::load_grad;
using device::nan_max;
using device::store_low;
using device::warp_nan_max;

__global__ void momentum8bit_step_kernel(const Segment* __restrict__ segments,
                                         const int64_t* __restrict__ block_starts, int64_t num_segments,
                                         int64_t total_blocks, const MomentumHyper* __restrict__ hyper,
                                         float* __restrict__ params, const void* __restrict__ grads,
                                         GradType grad_type, uint8_t* __restrict__ codes1, float* __restrict__ absmax1,
                                         float* __restrict__ state1, const float* __restrict__ qmap1, DeviceTables t1,
                                         bool scale, float inv_scale, void* low, LowType low_type) {
    __shared__ float q1[256], mid1[256];
    __shared__ uint8_t order1[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        q1[i] = qmap1[i];
        order1[i] = static_cast<uint8_t>(t1.order[i]);
        mid1[i] = t1.midpoints[i];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
    for (int64_t work = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); work < total_blocks;
         work += warps) {
        const int64_t lo = device::segment_of(block_starts, num_segments, work);
        const Segment s = segments[lo];
        const MomentumHyper h = hyper[s.hyper_row];
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
                    if (scale) g = g * inv_scale;
                    const float m_old = q1[codes1[i]] * a1;
                    if (isfinite(g)) {
                        m[k] = momentum_state(params[i], m_old, g, h);
                        params[i] = momentum_param(params[i], m[k], h);
                    } else {
                        m[k] = m_old;
                    }
                    max1 = nan_max(max1, fabsf(m[k]));
                    if (low != nullptr) store_low(low, low_type, i, params[i]);
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
                if (scale) g = g * inv_scale;
                if (isfinite(g)) {
                    const float m_new = momentum_state(params[i], state1[f], g, h);
                    params[i] = momentum_param(params[i], m_new, h);
                    state1[f] = m_new;
                }
                if (low != nullptr) store_low(low, low_type, i, params[i]);
            }
        }
    }
}

}  // namespace

int launch_momentum8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                             int64_t total_blocks, const MomentumHyper* hyper, float* params, const void* grads,
                             GradType grad_type, uint8_t* codes1, float* absmax1, float* state1, const float* qmap1,
                             DeviceTables tables1, bool scale, float inv_scale, void* low, LowType low_type,
                             void* stream) {
    if (total_blocks == 0) return 0;
    const int grid = device::grid_for(total_blocks);  // persistent, grid-stride
    momentum8bit_step_kernel<<<grid, 32 * kWarpsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
        segments, block_starts, num_segments, total_blocks, hyper, params, grads, grad_type, codes1, absmax1, state1,
        qmap1, tables1, scale, inv_scale, low, low_type);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dsbnb
