// adam8bit_rules.cuh — the per-element arithmetic of the fused AdamW CUDA kernels, one Rule per arithmetic (AdamIeee:
// the reference's IEEE fp32 rule; AdamBnb: bitsandbytes' own CUDA kernels), for fused_step.cuh's kernel skeleton.
// Included by adam8bit.cu (the product's launcher) and benchmarks/kernel_variants/kernel_variants.cu (the launch-shape
// sweep). Build and test: see adam8bit.cu.
#pragma once

#include "fused_step.cuh"

namespace dsbnb {
namespace cuda_rules {

// The launch shape of the product's AdamW kernels, both arithmetics (fused_step.cuh: Tuning; part k of the GPU proof
// times the alternatives; DSBNB_PRODUCT_SHAPE: a build's candidate instead, where one is given).
using AdamShape = DSBNB_PRODUCT_SHAPE(device::FullBlockBody);

struct AdamIeee : device::IeeeQuantizer {
    using Shape = AdamShape;
    static constexpr int kStates = 2;
    static constexpr bool kFloor = true;  // the second moment's positive floor (ops/reference.py)
    using Consts = Hyper;
    __device__ static __forceinline__ Consts prepare(const float* row) { return *reinterpret_cast<const Hyper*>(row); }
    template <bool Bf16, bool Selects = false>
    __device__ static __forceinline__ void update8(const Consts& h, float& p, float g, float (&s)[2][8], int k) {
        const bool finite = isfinite(g);  // a non-finite gradient keeps the element
        if (!Selects && !finite) return;
        float m, v;
        adam_moments(s[0][k], s[1][k], g, h, m, v);
        // Selects: computed for every gradient, the old values kept by a select (Tuning::kSelects)
        p = bnbmath::kept<Selects>(finite, adam_param(p, m, v, h), p);
        s[0][k] = bnbmath::kept<Selects>(finite, m, s[0][k]);
        s[1][k] = bnbmath::kept<Selects>(finite, v, s[1][k]);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& h, float& p, float g, float (&s)[2][8], int k,
                                                    int) {
        update8<Bf16>(h, p, g, s, k);
    }
};

struct AdamBnb : device::BnbQuantizer {
    using Shape = AdamShape;
    static constexpr int kStates = 2;
    template <bool Bf16, bool Selects = false>
    __device__ static __forceinline__ void update8(const Consts& c, float& p, float g, float (&s)[2][8], int k) {
        bnbmath::adam_8bit<Bf16, Selects>(c, p, g, s[0][k], s[1][k]);
    }
    template <bool Bf16>
    __device__ static __forceinline__ void update32(const Consts& c, float& p, float g, float (&s)[2][8], int k,
                                                    int) {
        bnbmath::adam_32bit<Bf16>(c, p, g, s[0][k], s[1][k]);
    }
};

}  // namespace cuda_rules
}  // namespace dsbnb
