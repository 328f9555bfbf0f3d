// momentum8bit_cpu.cpp — the C++ CPU implementation of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-
// momentum step (bitsandbytes' "momentum" rule: SGD8bit, SGD with momentum > 0) over a whole ZeRO partition, walking
// its segment table, parallel over 256-element blocks (ATen's thread pool).
//
// Per block, in one pass: gradient unscale/clip factor, dequantize the momentum (qmap[code] * absmax), coupled weight
// decay g + p * wd, the new momentum (g at step 1, else beta1 * m + g), p - lr * m on the fp32 master, then per-block
// absmax and requantization to the nearest code.
// Semantics: deepspeed_bnb/ops/reference.py (momentum8bit_step), bit for bit (tests/kernels/test_fused_rules.py); the
// arithmetic lives in csrc/include/dsbnb/adam8bit.h (momentum_state, momentum_param), shared with the CUDA kernel;
// the partition walk, checks, dispatch and quantizer in fused_cpu.h and the AVX-512 full-block path in
// adam8bit_avx512.h (momentum_update_block), shared with the AdamW and Lion kernels.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (kOptimizerStatic8bit1StateBlockwise and kOptimizer32bit1State,
// MOMENTUM), backends/cpu/ops.py and optim/sgd.py.
// Build: with the other kernels (deepspeed_bnb/ops/loader.py JIT, or setup.py with DEEPSPEED_BNB_BUILD_EXT=1); flags
// that keep it exact: -ffp-contract=off, no -ffast-math.
// Test: pytest tests/kernels/test_fused_rules.py -k momentum; tests/kernels/test_fused_momentum.py (its semantics by
// hand).

#include "fused_cpu.h"

namespace {

using dsbnb::MomentumHyper;

// bnb's SGD-momentum rule for dsbnb::cpu::one_state_step (fused_cpu.h), which does the rest of the operator.
struct MomentumRule {
    using Row = MomentumHyper;
    static constexpr int64_t kHyperFields = dsbnb::kMomentumHyperFields;

    // The SGD-momentum update of one element with a finite gradient: the new momentum, then the step along it.
    static void element(const MomentumHyper& h, float p_old, float m_old, float g, float& p, float& m) {
        m = dsbnb::momentum_state(p_old, m_old, g, h);
        p = dsbnb::momentum_param(p_old, m, h);
    }

    // The same in the 'bnb_cpu' arithmetic of fp32 segments: bnb's own 32-bit CPU update (bnb_cpu32.h).
    static void bnb32(const MomentumHyper& h, float p_old, float m_old, float g, float& p, float& m) {
        dsbnb::cpu::bnb32::momentum(h, p_old, m_old, g, p, m);
    }

#if DSBNB_AVX512
    template <dsbnb::avx512::Grad kind, bool Scale>
    static bool full_block(const Row& hyper, float* p, const void* g, const uint8_t* c1, float absmax,
                           const dsbnb::avx512::FastTables& t1, float inv_scale, float* m, float& max1) {
        return dsbnb::avx512::momentum_update_block<kind, Scale>(hyper, p, g, c1, absmax, t1, inv_scale, m, max1);
    }
#endif
};

void momentum8bit_step_cpu(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
    at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments, const at::Tensor& hyper,
    const std::optional<at::Tensor>& inv_scale, const std::optional<at::Tensor>& error,
    c10::string_view arithmetic, const std::optional<at::Tensor>& lp_params) {
    dsbnb::cpu::one_state_step<MomentumRule>("momentum8bit_step_", params, grads, codes1, absmax1, state1, qmap1,
                                             segments, hyper, inv_scale, error, arithmetic, lp_params);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CPU, m) { m.impl("momentum8bit_step_", &momentum8bit_step_cpu); }
