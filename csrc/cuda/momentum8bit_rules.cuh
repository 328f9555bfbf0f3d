// momentum8bit_rules.cuh — the per-element arithmetic of the fused SGD-momentum CUDA kernels, one Rule per arithmetic
// (MomentumIeee: the reference's IEEE fp32 rule; MomentumBnb: bitsandbytes' own CUDA kernels), for fused_step.cuh's
// kernel skeleton. Included by momentum8bit.cu (the product's launcher) and
// benchmarks/kernel_variants/kernel_variants.cu (the launch-shape sweep). Build and test: see momentum8bit.cu.
#pragma once

#include "fused_step.cuh"

namespace dsbnb {
namespace cuda_rules {

// The launch shape of the product's SGD-momentum kernels, both arithmetics (fused_step.cuh: Tuning; part k of the GPU
// proof times the alternatives; DSBNB_PRODUCT_SHAPE: a build's candidate instead, where one is given).
using MomentumShape = DSBNB_PRODUCT_SHAPE(device::FullBlockBody);

struct MomentumIeee : device::IeeeQuantizer {
    using Shape = MomentumShape;
    static constexpr int kStates = 1;
    static constexpr bool kFloor = false;
    using Consts = MomentumHyper;
    __device__ static __forceinline__ Consts prepare(const float* row) {
        return *reinterpret_cast<const MomentumHyper*>(row);
    }
    // the new momentum first (coupled decay reads the old p), then the parameter from it
    template <bool Bf16, bool Selects = false>
    __device__ static __forceinline__ void update8(const Consts& h, float& p, float g, float (&s)[1][8], int k) {
        const bool finite = isfinite(g);  // a non-finite gradient keeps the element
        if (!Selects && !finite) return;
        // Selects: computed for every gradient, the old values kept by a select (Tuning::kSelects); p's update reads
        // the new momentum (for a non-finite gradient both are dropped)
        s[0][k] = bnbmath::kept<Selects>(finite, momentum_state(p, s[0][k], g, h), s[0][k]);
        p = bnbmath::kept<Selects>(finite, momentum_param(p, s[0][k], h), p);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& h, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        update8<Bf16>(h, p, g, s, k);
    }
};

struct MomentumBnb : device::BnbQuantizer {
    using Shape = MomentumShape;
    static constexpr int kStates = 1;
    template <bool Bf16, bool Selects = false>
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

}  // namespace cuda_rules
}  // namespace dsbnb
