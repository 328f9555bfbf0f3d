// momentum8bit.cu — the CUDA kernel of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-momentum step
// (bitsandbytes' "momentum" rule) over a whole ZeRO partition: the rule (MomentumRule below) plugged into the
// one-state kernel of fused_device.cuh, which the Lion kernel (lion8bit.cu) shares.
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
// Test: pytest tests/test_fused_rules.py -k momentum (runs its CUDA cases where a GPU is present);
// tests/test_cuda_build.py.

#include "fused_device.cuh"

namespace dsbnb {
namespace {

// bnb's SGD-momentum rule: the new momentum (from the old p), then the step with it.
struct MomentumRule {
    using Row = MomentumHyper;
    __device__ static __forceinline__ void apply(float& p, float m_old, float g, const Row& h, float& m_new) {
        m_new = momentum_state(p, m_old, g, h);  // coupled weight decay reads the old p
        p = momentum_param(p, m_new, h);
    }
};

}  // namespace

int launch_momentum8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
    int64_t total_blocks, const MomentumHyper* hyper, Master params, const void* grads, GradType grad_type,
    uint8_t* codes1, float* absmax1, float* state1, const float* qmap1, DeviceTables tables1, const float* inv_scale,
    void* stream) {
    return device::launch_one_state_step<MomentumRule>(segments, block_starts, num_segments, total_blocks, hyper,
        params, grads, grad_type, codes1, absmax1, state1, qmap1, tables1, inv_scale, stream);
}

}  // namespace dsbnb
