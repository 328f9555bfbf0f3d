// lion8bit.cu — the CUDA kernels of deepspeed_bnb::lion8bit_step_: one fused 8-bit Lion step over a whole ZeRO
// partition, 8-bit and 32-bit state in one launch (the kernel: fused_step.cuh), in either arithmetic:
//   ieee      the project's Lion (decoupled decay before the signed step, IEEE fp32 operations):
//             deepspeed_bnb/ops/reference.py (lion8bit_step), bit for bit; the per-element arithmetic is shared with
//             the CPU kernel through csrc/include/dsbnb/adam8bit.h;
//   bnb_cuda  bitsandbytes' own CUDA Lion kernels (csrc/include/dsbnb/bnb_cuda_math.h:
//             kOptimizerStatic8bit1StateBlockwise<LION>, kOptimizer32bit1State<LION>).
// References: bitsandbytes 0.50.2 csrc/kernels.cu; Chen et al., Symbolic Discovery of Optimization Algorithms.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding (lion8bit_cuda.cpp).
// It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/lion8bit.cu -o /tmp/lion8bit.o
// Flags that keep the ieee arithmetic exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/kernels/test_fused_rules.py -k lion (ieee, where a GPU is present);
// tests/kernels/test_cuda_build.py; the GPU proof's kernel part (bnb_cuda against bitsandbytes itself).

#include "fused_step.cuh"

namespace dsbnb {
namespace {

struct LionIeee : device::IeeeQuantizer {
    static constexpr int kStates = 1;
    static constexpr bool kFloor = false;
    using Consts = LionHyper;
    __device__ static __forceinline__ Consts prepare(const float* row) {
        return *reinterpret_cast<const LionHyper*>(row);
    }
    // the step uses the old momentum, the new momentum follows
    template <bool Bf16>
    __device__ static __forceinline__ void update8(const Consts& h, float& p, float g, float (&s)[1][8], int k) {
        if (!isfinite(g)) return;  // a non-finite gradient keeps the element
        const float m_old = s[0][k];
        s[0][k] = lion_momentum(m_old, g, h);
        p = lion_param(p, m_old, g, h);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& h, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        update8<Bf16>(h, p, g, s, k);
    }
};

struct LionBnb : device::BnbQuantizer {
    static constexpr int kStates = 1;
    template <bool Bf16>
    __device__ static __forceinline__ void update8(const Consts& c, float& p, float g, float (&s)[1][8], int k) {
        bnbmath::lion_8bit<Bf16>(c, p, g, s[0][k]);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& c, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        bnbmath::lion_32bit<Bf16>(c, p, g, s[0][k]);
    }
};

}  // namespace

int launch_lion8bit_step(const StepArgs& args, bool bnb, void* stream) {
    return bnb ? device::launch<LionBnb>(args, stream) : device::launch<LionIeee>(args, stream);
}

}  // namespace dsbnb
