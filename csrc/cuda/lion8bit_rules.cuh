// lion8bit_rules.cuh — the per-element arithmetic of the fused Lion CUDA kernels, one Rule per arithmetic (LionIeee:
// the reference's IEEE fp32 rule; LionBnb: bitsandbytes' own CUDA kernels), for fused_step.cuh's kernel skeleton.
// Included by lion8bit.cu (the product's launcher) and benchmarks/kernel_variants/kernel_variants.cu (the launch-shape
// sweep). Build and test: see lion8bit.cu.
#pragma once

#include "fused_step.cuh"

namespace dsbnb {
namespace cuda_rules {

// The launch shape of the product's Lion kernels, both arithmetics (fused_step.cuh: Tuning; part k of the GPU proof
// times the alternatives; DSBNB_PRODUCT_SHAPE: a build's candidate instead, where one is given).
using LionShape = DSBNB_PRODUCT_SHAPE(device::FullBlockBody);

struct LionIeee : device::IeeeQuantizer {
    using Shape = LionShape;
    static constexpr int kStates = 1;
    static constexpr bool kFloor = false;
    using Consts = LionHyper;
    __device__ static __forceinline__ Consts prepare(const float* row) {
        return *reinterpret_cast<const LionHyper*>(row);
    }
    // the step uses the old momentum, the new momentum follows
    template <bool Bf16, bool Selects = false>
    __device__ static __forceinline__ void update8(const Consts& h, float& p, float g, float (&s)[1][8], int k) {
        const bool finite = isfinite(g);  // a non-finite gradient keeps the element
        if (!Selects && !finite) return;
        const float m_old = s[0][k];
        // Selects: computed for every gradient, the old values kept by a select (Tuning::kSelects)
        s[0][k] = bnbmath::kept<Selects>(finite, lion_momentum(m_old, g, h), m_old);
        p = bnbmath::kept<Selects>(finite, lion_param(p, m_old, g, h), p);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& h, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        update8<Bf16>(h, p, g, s, k);
    }
};

struct LionBnb : device::BnbQuantizer {
    using Shape = LionShape;
    static constexpr int kStates = 1;
    template <bool Bf16, bool Selects = false>
    __device__ static __forceinline__ void update8(const Consts& c, float& p, float g, float (&s)[1][8], int k) {
        bnbmath::lion_8bit<Bf16>(c, p, g, s[0][k]);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& c, float& p, float g, float (&s)[1][8], int k,
                                                    int) {
        bnbmath::lion_32bit<Bf16>(c, p, g, s[0][k]);
    }
};

}  // namespace cuda_rules
}  // namespace dsbnb
