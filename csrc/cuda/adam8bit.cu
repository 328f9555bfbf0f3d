// adam8bit.cu — the CUDA kernel of deepspeed_bnb::adam8bit_step_: one fused 8-bit AdamW step over a whole ZeRO
// partition. One warp per 256-element block (8 elements per lane, coalesced), grid-stride over the blocks of all
// segments, maps and midpoints in shared memory, NaN-propagating absmax by warp shuffles, 64-bit indexing; fp32, bf16
// or compensated master weights (dsbnb/master_weights.h).
//
// Semantics: deepspeed_bnb/ops/reference.py, bit for bit; the per-element arithmetic is shared with the CPU kernel
// through csrc/include/dsbnb/adam8bit.h, the launch shape and device helpers with the Lion kernel (lion8bit.cu)
// through fused_device.cuh. References: bitsandbytes 0.50.2 csrc/kernels.cu
// (kOptimizerStatic8bit2StateBlockwise), llm.c's adamw kernel, apex multi-tensor apply.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with the binding
// (adam8bit_cuda.cpp). It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/adam8bit.cu -o /tmp/adam8bit.o
// Flags that keep it exact: -fmad=false, and no --use_fast_math (IEEE division and sqrt are nvcc's defaults).
// Test: pytest tests/test_fused_rules.py -k adam (runs its CUDA cases where a GPU is present).

#include "fused_device.cuh"

namespace dsbnb {
namespace {

using device::kPerLane;
using device::kWarpsPerBlock;
using device::load_grad;
using device::nan_max;
using device::warp_nan_max;

__global__ void adam8bit_step_kernel(const Segment* __restrict__ segments, const int64_t* __restrict__ block_starts,
                                     int64_t num_segments, int64_t total_blocks, const Hyper* __restrict__ hyper,
                                     Master params, const void* __restrict__ grads, GradType grad_type,
                                     uint8_t* __restrict__ codes1, uint8_t* __restrict__ codes2,
                                     float* __restrict__ absmax1, float* __restrict__ absmax2,
                                     float* __restrict__ state1, float* __restrict__ state2,
                                     const float* __restrict__ qmap1, const float* __restrict__ qmap2,
                                     DeviceTables t1, DeviceTables t2, const float* inv_scale) {
    __shared__ float q1[256], q2[256], mid1[256], mid2[256];
    __shared__ uint8_t order1[256], order2[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        q1[i] = qmap1[i];
        q2[i] = qmap2[i];
        order1[i] = static_cast<uint8_t>(t1.order[i]);
        order2[i] = static_cast<uint8_t>(t2.order[i]);
        mid1[i] = t1.midpoints[i];
        mid2[i] = t2.midpoints[i];
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
        const Hyper h = hyper[s.hyper_row];
        const int64_t start = (work - block_starts[lo]) * kBlock;
        const int64_t len = min(kBlock, s.numel - start);
        const int64_t base = s.offset + start;
        float m[kPerLane], v[kPerLane];
        if (s.eight_bit) {
            const int64_t block = base / kBlock;
            const float a1 = absmax1[block], a2 = absmax2[block];
            float max1 = 0.0f, max2 = 0.0f;
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                const int64_t j = lane + 32 * k;
                m[k] = 0.0f;
                v[k] = 0.0f;
                if (j < len) {
                    const int64_t i = base + j;
                    float g = load_grad(grads, grad_type, i);
                    if (scale) g = g * factor;
                    const float m_old = q1[codes1[i]] * a1;
                    const float v_old = q2[codes2[i]] * a2;
                    float p = load_master(params, i);
                    if (isfinite(g)) {
                        adam_moments(m_old, v_old, g, h, m[k], v[k]);
                        p = adam_param(p, m[k], v[k], h);
                    } else {
                        m[k] = m_old;
                        v[k] = v_old;
                    }
                    store_master(params, i, p);  // unchanged: the same bits (a NaN bf16 weight canonical)
                    max1 = nan_max(max1, fabsf(m[k]));
                    max2 = nan_max(max2, fabsf(v[k]));
                }
            }
            max1 = warp_nan_max(max1);
            max2 = warp_nan_max(max2);
            const float r1 = reciprocal(max1), r2 = reciprocal(max2);
#pragma unroll
            for (int k = 0; k < kPerLane; ++k) {
                const int64_t j = lane + 32 * k;
                if (j < len) {
                    const int64_t i = base + j;
                    codes1[i] = order1[nearest_sorted(normalize(m[k], r1), mid1, t1.lut, t1.max_walk)];
                    codes2[i] = floor_positive(order2[nearest_sorted(normalize(v[k], r2), mid2, t2.lut, t2.max_walk)],
                                               v[k], t2.floor);
                }
            }
            if (lane == 0) {
                absmax1[block] = max1;
                absmax2[block] = max2;
            }
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
                    float mm, vv;
                    adam_moments(state1[f], state2[f], g, h, mm, vv);
                    p = adam_param(p, mm, vv, h);
                    state1[f] = mm;
                    state2[f] = vv;
                }
                store_master(params, i, p);
            }
        }
    }
}

}  // namespace

int launch_adam8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                         int64_t total_blocks, const Hyper* hyper, Master params, const void* grads, GradType grad_type,
                         uint8_t* codes1, uint8_t* codes2, float* absmax1, float* absmax2, float* state1,
                         float* state2, const float* qmap1, const float* qmap2, DeviceTables tables1,
                         DeviceTables tables2, const float* inv_scale, void* stream) {
    if (total_blocks == 0) return 0;
    const int grid = device::grid_for(total_blocks);  // persistent, grid-stride
    adam8bit_step_kernel<<<grid, 32 * kWarpsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
        segments, block_starts, num_segments, total_blocks, hyper, params, grads, grad_type, codes1, codes2, absmax1,
        absmax2, state1, state2, qmap1, qmap2, tables1, tables2, inv_scale);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace dsbnb
