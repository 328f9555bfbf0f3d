// momentum8bit.cu — the CUDA kernels of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-momentum step
// (bnb's "momentum" rule) over a whole ZeRO partition, 8-bit and 32-bit state in one launch (the kernel:
// fused_step.cuh), in either arithmetic:
//   ieee      the project's rule (coupled decay, m = g at step 1, IEEE fp32 operations):
//             deepspeed_bnb/ops/reference.py (momentum8bit_step), bit for bit; the per-element arithmetic is shared
//             with the CPU kernel through csrc/include/dsbnb/adam8bit.h;
//   bnb_cuda  bitsandbytes' own CUDA kernels (csrc/include/dsbnb/bnb_cuda_math.h:
//             kOptimizerStatic8bit1StateBlockwise<MOMENTUM>, kOptimizer32bit1State<MOMENTUM>).
// References: bitsandbytes 0.50.2 csrc/kernels.cu and optim/sgd.py.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding
// (momentum8bit_cuda.cpp). It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/momentum8bit.cu -o /tmp/momentum8bit.o
// Flags that keep the ieee arithmetic exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/kernels/test_fused_rules.py -k momentum (ieee, where a GPU is present);
// tests/kernels/test_cuda_build.py; the GPU proof's kernel part (bnb_cuda against bitsandbytes itself).

#include "fused_step.cuh"

namespace dsbnb {
namespace {

struct MomentumIeee : device::IeeeQuantizer {
    static constexpr int kStates = 1;
    static constexpr bool kFloor = false;
    using Consts = MomentumHyper;
    __device__ static __forceinline__ Consts prepare(const float* row) {
        return *reinterpret_cast<const MomentumHyper*>(row);
    }
    // the new momentum first (coupled decay reads the old p), then the parameter from it
    template <bool Bf16>
    __device__ static __forceinline__ void update8(const Consts& h, float& p, float g, float (&s)[1][8], int k) {
        if (!isfinite(g)) return;  // a non-finite gradient keeps the element
        s[0][k] = momentum_state(p, s[0][k], g, h);
        p = momentum_param(p, s[0][k], h);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& h, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        update8<Bf16>(h, p, g, s, k);
    }
};

struct MomentumBnb : device::BnbQuantizer {
    static constexpr int kStates = 1;
    template <bool Bf16>
    __device__ static __forceinline__ void update8(const Consts& c, float& p, float g, float (&s)[1][8], int k) {
        bnbmath::momentum_8bit<Bf16>(c, p, g, s[0][k]);
    }
    // bnb's f32 kernel fuses the decay term differently for the first of every four elements of its call
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& c, float& p, float g, float (&s)[1][8], int k,
                                                    int index) {
        bnbmath::momentum_32bit<Bf16>(c, p, g, s[0][k], index & 3);
    }
};

}  // namespace

int launch_momentum8bit_step(const StepArgs& args, bool bnb, void* stream) {
    return bnb ? device::launch<MomentumBnb>(args, stream) : device::launch<MomentumIeee>(args, stream);
}

}  // namespace dsbnb
