// lion8bit_cpu.cpp — the C++ CPU implementation of deepspeed_bnb::lion8bit_step_: one fused 8-bit Lion step over a
// whole ZeRO partition, walking its segment table, parallel over 256-element blocks (ATen's thread pool).
//
// Per block, in one pass: gradient unscale/clip factor, dequantize the momentum (qmap[code] * absmax), decoupled
// weight decay and the signed step lr * sign(beta1 * m + (1 - beta1) * g) on the fp32 master, the new momentum
// beta2 * m + (1 - beta2) * g, then per-block absmax and requantization to the nearest code.
// Semantics: deepspeed_bnb/ops/reference.py (lion8bit_step), bit for bit (tests/kernels/test_fused_rules.py); the
// arithmetic lives in csrc/include/dsbnb/adam8bit.h (lion_param, lion_momentum), shared with the CUDA kernel; the
// partition walk, checks, dispatch and quantizer in fused_cpu.h and the AVX-512 full-block path in adam8bit_avx512.h,
// shared with the AdamW kernel (adam8bit_cpu.cpp).
// References: bitsandbytes 0.50.2 csrc/kernels.cu (kOptimizerStatic8bit1StateBlockwise, LION) and
// backends/cpu/ops.py; Chen et al. 2023, Symbolic Discovery of Optimization Algorithms.
// Build: with the AdamW kernel (deepspeed_bnb/ops/loader.py JIT, or setup.py with DEEPSPEED_BNB_BUILD_EXT=1); flags
// that keep it exact: -ffp-contract=off, no -ffast-math.
// Test: pytest tests/kernels/test_fused_rules.py -k lion, tests/kernels/test_fused_lion.py;
// speed: python benchmarks/bench_optimizer_step.py.

#include "fused_cpu.h"

namespace {

using dsbnb::LionHyper;

// bnb's Lion rule for dsbnb::cpu::one_state_step (fused_cpu.h), which does the rest of the operator.
struct LionRule {
    using Row = LionHyper;
    static constexpr int64_t kHyperFields = dsbnb::kLionHyperFields;

    // The Lion update of one element with a finite gradient: the step from the old momentum, then the new momentum.
    static void element(const LionHyper& h, float p_old, float m_old, float g, float& p, float& m) {
        p = dsbnb::lion_param(p_old, m_old, g, h);
        m = dsbnb::lion_momentum(m_old, g, h);
    }

    // The same in the 'bnb_cpu' arithmetic of fp32 segments: bnb's own 32-bit CPU update (bnb_cpu32.h).
    static void bnb32(const LionHyper& h, float p_old, float m_old, float g, float& p, float& m) {
        dsbnb::cpu::bnb32::lion(h, p_old, m_old, g, p, m);
    }

#if DSBNB_AVX512
    template <dsbnb::avx512::Grad kind, bool Scale>
    static bool full_block(const Row& hyper, float* p, const void* g, const uint8_t* c1, float absmax,
                           const dsbnb::avx512::FastTables& t1, float inv_scale, float* m, float& max1) {
        return dsbnb::avx512::lion_update_block<kind, Scale>(hyper, p, g, c1, absmax, t1, inv_scale, m, max1);
    }
#endif
};

void lion8bit_step_cpu(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
    at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments, const at::Tensor& hyper,
    const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& error,
    c10::string_view arithmetic, const std::optional<at::Tensor>& lp_params) {
    dsbnb::cpu::one_state_step<LionRule>("lion8bit_step_", params, grads, codes1, absmax1, state1, qmap1, segments,
                                         hyper, inv_scale, error, arithmetic, lp_params);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CPU, m) { m.impl("lion8bit_step_", &lion8bit_step_cpu); }
