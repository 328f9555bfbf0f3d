// momentum8bit_cpu.cpp — the C++ CPU implementation of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-
// momentum step (bitsandbytes' "momentum" rule: SGD8bit, SGD with momentum > 0) over a whole ZeRO partition, walking
// its segment table, parallel over 256-element blocks (ATen's thread pool).
//
// Per block, in one pass: gradient unscale/clip factor, dequantize the momentum (qmap[code] * absmax), coupled weight
// decay g + p * wd, the new momentum (g at step 1, else beta1 * m + g), p - lr * m on the fp32 master, optional
// bf16/fp16 copy, then per-block absmax and requantization to the nearest code.
// Semantics: deepspeed_bnb/ops/reference.py (momentum8bit_step), bit for bit (tests/test_fused_momentum.py); the
// arithmetic lives in csrc/include/dsbnb/adam8bit.h (momentum_state, momentum_param), shared with the CUDA kernel;
// the partition walk, checks, dispatch and quantizer in fused_cpu.h and the AVX-512 full-block path in
// adam8bit_avx512.h (momentum_update_block), shared with the AdamW and Lion kernels.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (kOptimizerStatic8bit1StateBlockwise and kOptimizer32bit1State,
// MOMENTUM), backends/cpu/ops.py and optim/sgd.py.
// Build: with the other kernels (deepspeed_bnb/ops/loader.py JIT, or setup.py with DEEPSPEED_BNB_BUILD_EXT=1); flags
// that keep it exact: -ffp-contract=off, no -ffast-math.
// Test: pytest tests/test_fused_momentum.py.

#include "fused_cpu.h"

namespace {

using dsbnb::kBlock;
using dsbnb::MomentumHyper;
using dsbnb::cpu::MapTables;

// The SGD-momentum update of elements whose old momentum is m_old: writes p and the new momentum m (a non-finite
// gradient keeps both). m may alias m_old (fp32 state updated in place).
template <typename GradT, bool Scale>
inline void update(const MomentumHyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                   const float* m_old, float inv_scale, float* m) {
    const MomentumHyper h = hyper;  // a local copy: the compiler need not reload it around stores through p
    alignas(64) float g[kBlock];
    dsbnb::cpu::widen_grads<GradT, Scale>(len, g_in, inv_scale, g);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        const float old = m_old[j];
        const float mn = dsbnb::momentum_state(p[j], old, g[j], h);
        const float pn = dsbnb::momentum_param(p[j], mn, h);
        const bool ok = dsbnb::cpu::finite(g[j]);
        p[j] = ok ? pn : p[j];
        m[j] = ok ? mn : old;
    }
}

// One block (up to 256 elements) of an 8-bit segment: update, absmax, requantize. Full blocks of bnb-style maps take
// the AVX-512 path where it is compiled in; the rest the portable loops. Both give the same bits.
template <typename GradT, bool Scale>
void block_8bit(const MomentumHyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                uint8_t* __restrict__ c1, float* a1, const float* __restrict__ q1, const MapTables& t1,
                float inv_scale) {
    alignas(64) float m[kBlock];
    float max1;
#if DSBNB_AVX512
    if (len == kBlock && t1.fast_usable()) {
        if (!dsbnb::avx512::momentum_update_block<dsbnb::cpu::grad_kind<GradT>(), Scale>(hyper, p, g_in, c1, *a1,
                                                                                          t1.fast, inv_scale, m,
                                                                                          max1)) {
            max1 = dsbnb::cpu::block_absmax(len, m);  // a NaN momentum: the first-NaN rule
        }
        dsbnb::cpu::quantize_full_block(t1.fast, m, dsbnb::reciprocal(max1), c1);
        *a1 = max1;
        return;
    }
#endif
    alignas(64) float m_old[kBlock];
    dsbnb::cpu::dequantize_block(len, c1, *a1, q1, m_old);
    update<GradT, Scale>(hyper, len, p, g_in, m_old, inv_scale, m);
    max1 = dsbnb::cpu::block_absmax(len, m);
    dsbnb::cpu::quantize_block(len, m, dsbnb::reciprocal(max1), c1, t1.generic);
    *a1 = max1;
}

void momentum8bit_step_cpu(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
                           at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments,
                           const at::Tensor& hyper, double inv_scale, const std::optional<at::Tensor>& lp_params) {
    const dsbnb::cpu::Checker check("momentum8bit_step_");
    check.expect(params, "params", at::kFloat);
    check.expect(codes1, "codes1", at::kByte);
    check.expect(absmax1, "absmax1", at::kFloat);
    check.expect(state1, "state1", at::kFloat);
    check.expect(qmap1, "qmap1", at::kFloat);
    check(qmap1.numel() == 256, "qmap1 must hold 256 entries");
    const dsbnb::StateSizes states[1] = {{codes1.numel(), absmax1.numel(), state1.numel()}};
    const std::vector<dsbnb::cpu::Work> work =
        dsbnb::cpu::plan_blocks(check, segments, hyper, dsbnb::kMomentumHyperFields, params.numel(), states, 1);
    const MapTables& t1 = dsbnb::cpu::tables_for(qmap1);
    const float inv = static_cast<float>(inv_scale);
    const auto* h = reinterpret_cast<const MomentumHyper*>(hyper.data_ptr<float>());
    float* p = params.data_ptr<float>();
    uint8_t* c1 = codes1.data_ptr<uint8_t>();
    float* a1 = absmax1.data_ptr<float>();
    float* s1 = state1.data_ptr<float>();
    const float* q1 = qmap1.data_ptr<float>();
    dsbnb::cpu::dispatch(check, params, grads, lp_params, inv_scale, [&](auto* g, auto* low, auto scale) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        constexpr bool kScale = decltype(scale)::value;
        dsbnb::cpu::for_each_block(segments, work, p, low, [&](const dsbnb::Segment& s, int64_t start, int64_t len,
                                                                 int64_t base) {
            if (s.eight_bit) {
                block_8bit<G, kScale>(h[s.hyper_row], len, p + base, g + base, c1 + base, a1 + base / kBlock, q1, t1,
                                      inv);
            } else {
                float* m = s1 + s.fp32_offset + start;
                update<G, kScale>(h[s.hyper_row], len, p + base, g + base, m, inv, m);
            }
        });
    });
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CPU, m) { m.impl("momentum8bit_step_", &momentum8bit_step_cpu); }
