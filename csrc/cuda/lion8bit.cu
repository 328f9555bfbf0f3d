// lion8bit.cu — the CUDA kernel of deepspeed_bnb::lion8bit_step_: one fused 8-bit Lion step over a whole ZeRO
// partition: bnb's Lion rule (LionRule below) plugged into the one-state kernel of fused_device.cuh (one warp per
// 256-element block, grid-stride over the blocks of all segments, map and midpoints in shared memory,
// NaN-propagating absmax by warp shuffles, 64-bit indexing), which SGD-momentum (momentum8bit.cu) shares.
//
// Semantics: deepspeed_bnb/ops/reference.py (lion8bit_step), bit for bit; the per-element arithmetic
// (dsbnb::lion_param, lion_momentum) is shared with the CPU kernel through csrc/include/dsbnb/adam8bit.h, the launch
// shape and device helpers with the AdamW kernel through fused_device.cuh. References: bitsandbytes 0.50.2
// csrc/kernels.cu (kOptimizerStatic8bit1StateBlockwise, LION; kOptimizer32bit1State).
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding (lion8bit_cuda.cpp).
// It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/lion8bit.cu -o /tmp/lion8bit.o
// Flags that keep it exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/test_fused_rules.py -k lion (runs its CUDA cases where a GPU is present);
// tests/test_cuda_build.py.

#include "fused_device.cuh"

namespace dsbnb {
namespace {

// bnb's Lion rule: the step uses the old momentum, the new momentum is returned beside it.
struct LionRule {
    using Row = LionHyper;
    __device__ static __forceinline__ void apply(float& p, float m_old, float g, const Row& h, float& m_new) {
        m_new = lion_momentum(m_old, g, h);
        p = lion_param(p, m_old, g, h);
    }
};

}  // namespace

int launch_lion8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
    int64_t total_blocks, const LionHyper* hyper, Master params, const void* grads, GradType grad_type,
    uint8_t* codes1, float* absmax1, float* state1, const float* qmap1, DeviceTables tables1, const float* inv_scale,
    void* stream) {
    return device::launch_one_state_step<LionRule>(segments, block_starts, num_segments, total_blocks, hyper,
        params, grads, grad_type, codes1, absmax1, state1, qmap1, tables1, inv_scale, stream);
}

}  // namespace dsbnb
