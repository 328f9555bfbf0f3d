// adam8bit_cpu.cpp — the C++ CPU implementation of deepspeed_bnb::adam8bit_step_: one fused 8-bit AdamW step over a
// whole ZeRO partition, walking its segment table, parallel over 256-element blocks (ATen's thread pool).
//
// Per block, in one pass: gradient unscale/clip factor, dequantize (qmap[code] * absmax), moments, decoupled weight
// decay and parameter update (fp32 master weights, or bf16 / compensated ones widened per block: fused_cpu.h), then
// per-block absmax and requantization to the nearest code.
// Semantics: deepspeed_bnb/ops/reference.py, bit for bit (tests/kernels/test_fused_rules.py), in its 'ieee'
// arithmetic or its 'bnb_cpu' one (fp32 segments as bnb's own 32-bit CPU update: bnb_cpu32.h, in two passes around
// torch's sqrt); the arithmetic itself lives in csrc/include/dsbnb/adam8bit.h, shared with the CUDA kernel; the
// partition walk, checks, dispatch and quantizer helpers in fused_cpu.h, shared with the Lion kernel
// (lion8bit_cpu.cpp).
// References: bitsandbytes 0.50.2 csrc/kernels.cu (kOptimizerStatic8bit2StateBlockwise), llm.c's AdamW kernels.
// Build: JIT by deepspeed_bnb/ops/loader.py (ninja; cached under TORCH_EXTENSIONS_DIR), or ahead of time with
// `DEEPSPEED_BNB_BUILD_EXT=1 pip install -e .`. Flags that keep it exact: -ffp-contract=off, no -ffast-math.
// Test: pytest tests/kernels/test_fused_rules.py -k adam, tests/kernels/test_fused_adam.py;
// speed: python benchmarks/bench_optimizer_step.py.

#include <ATen/ops/sqrt.h>

#include "fused_cpu.h"

namespace {

using dsbnb::Hyper;
using dsbnb::kBlock;
using dsbnb::cpu::MapTables;

// The update of one block by portable, compiler-vectorized loops: dequantize, moments, parameter; writes p, m, v.
template <typename GradT, bool Scale>
void update_block(const Hyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                  const uint8_t* __restrict__ c1, const uint8_t* __restrict__ c2, float scale1, float scale2,
                  const float* __restrict__ q1, const float* __restrict__ q2, float inv_scale, float* __restrict__ m,
                  float* __restrict__ v) {
    const Hyper h = hyper;  // a local copy: the compiler need not reload it around stores through p
    alignas(64) float m_old[kBlock], v_old[kBlock], g[kBlock];
    // gathers and conversions apart: the arithmetic below is contiguous
    dsbnb::cpu::dequantize_block(len, c1, scale1, q1, m_old);
    dsbnb::cpu::dequantize_block(len, c2, scale2, q2, v_old);
    dsbnb::cpu::widen_grads<GradT, Scale>(len, g_in, inv_scale, g);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        float mm, vv;
        const float p_old = p[j];
        dsbnb::adam_moments(m_old[j], v_old[j], g[j], h, mm, vv);
        const float pn = dsbnb::adam_param(p_old, mm, vv, h);
        const bool ok = dsbnb::cpu::finite(g[j]);
        m[j] = dsbnb::cpu::select(ok, mm, m_old[j]);
        v[j] = dsbnb::cpu::select(ok, vv, v_old[j]);
        p[j] = dsbnb::cpu::select(ok, pn, p_old);
    }
}

// One block (up to 256 elements) of an 8-bit segment: update, absmax, requantize. Full blocks of bnb-style maps take
// the AVX-512 path where it is compiled in (adam8bit_avx512.h: no gathers to dequantize, one per quantized value);
// the rest the portable loops. Both give the same bits.
template <typename GradT, bool Scale>
void block_8bit(const Hyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                uint8_t* __restrict__ c1, uint8_t* __restrict__ c2, float* a1, float* a2, const float* __restrict__ q1,
                const float* __restrict__ q2, const MapTables& t1, const MapTables& t2, float inv_scale) {
    alignas(64) float m[kBlock], v[kBlock];
    float max1, max2;
#if DSBNB_AVX512
    if (len == kBlock && t1.fast_usable() && t2.fast_usable()) {
        bool v_signless;  // no new second moment has its sign bit set: read off the update, not assumed
        const bool nan_free = dsbnb::avx512::update_block<dsbnb::cpu::grad_kind<GradT>(), Scale>(
            hyper, p, g_in, c1, c2, *a1, *a2, t1.fast, t2.fast, inv_scale, m, v, max1, max2, v_signless);
        if (!nan_free) {
            max1 = dsbnb::cpu::block_absmax(len, m);  // a NaN moment: the first-NaN rule
            max2 = dsbnb::cpu::block_absmax(len, v);
        }
        dsbnb::cpu::quantize_full_block(t1, m, max1, nan_free, c1);
        dsbnb::cpu::quantize_full_block(t2, v, max2, nan_free, c2, true, v_signless);
        *a1 = max1;
        *a2 = max2;
        return;
    }
#endif
    update_block<GradT, Scale>(hyper, len, p, g_in, c1, c2, *a1, *a2, q1, q2, inv_scale, m, v);
    max1 = dsbnb::cpu::block_absmax(len, m);
    max2 = dsbnb::cpu::block_absmax(len, v);
    dsbnb::cpu::quantize_block(len, m, dsbnb::reciprocal(max1), c1, t1);
    dsbnb::cpu::quantize_block(len, v, dsbnb::reciprocal(max2), c2, t2);
    dsbnb::cpu::floor_positive_block(len, v, c2, t2.generic.floor);
    *a1 = max1;
    *a2 = max2;
}

template <typename GradT, bool Scale>
void block_fp32(const Hyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                float* __restrict__ s1, float* __restrict__ s2, float inv_scale) {
    const Hyper h = hyper;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        float g = dsbnb::cpu::to_float(g_in[j]);
        if (Scale) g = g * inv_scale;
        float mm, vv;
        const float m_old = s1[j], v_old = s2[j], p_old = p[j];
        dsbnb::adam_moments(m_old, v_old, g, h, mm, vv);
        const float pn = dsbnb::adam_param(p_old, mm, vv, h);
        const bool ok = dsbnb::cpu::finite(g);
        s1[j] = dsbnb::cpu::select(ok, mm, m_old);
        s2[j] = dsbnb::cpu::select(ok, vv, v_old);
        p[j] = dsbnb::cpu::select(ok, pn, p_old);
    }
}

// The 'bnb_cpu' arithmetic of the fp32 segments (bnb_cpu32.h), in two passes around torch's own square root of the
// packed second moments. First pass, here: every fp32 segment's moments in place (every element: bnb lets a
// non-finite gradient into the state), over those segments' blocks only (a partition's 8-bit blocks may number
// millions); returns that square root (fp32 state outside the launch is read, never written).
template <typename GradT, bool Scale>
at::Tensor bnb32_moments(const at::Tensor& segments, const Hyper* hyper, const GradT* grads, float* s1, float* s2,
                         const at::Tensor& state2, float inv_scale) {
    const auto* table = reinterpret_cast<const dsbnb::Segment*>(segments.data_ptr<int64_t>());
    const dsbnb::cpu::BlockPlan fp32_work =
        dsbnb::cpu::count_blocks(table, segments.size(0), [](const dsbnb::Segment& s) { return !s.eight_bit; });
    dsbnb::cpu::for_each_block(segments, fp32_work, [&](const dsbnb::Segment& s, int64_t start, int64_t len,
                                                        int64_t base) {
        const Hyper h = hyper[s.hyper_row];
        const GradT* __restrict__ g = grads + base;
        float* __restrict__ m = s1 + s.fp32_offset + start;
        float* __restrict__ v = s2 + s.fp32_offset + start;
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
            dsbnb::cpu::bnb32::adam_moments(h, m[j], v[j], dsbnb::cpu::bnb32::grad<GradT, Scale>(g[j], inv_scale),
                                            m[j], v[j]);
        }
    });
    return at::sqrt(state2);
}

// Second pass, per block: the parameters, from the new first moments and the square roots of the second ones.
inline void bnb32_params(const Hyper& hyper, int64_t len, float* __restrict__ p, const float* __restrict__ s1,
                         const float* __restrict__ root) {
    const Hyper h = hyper;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) p[j] = dsbnb::cpu::bnb32::adam_param(h, p[j], s1[j], root[j]);
}

void adam8bit_step_cpu(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor codes2,
                       at::Tensor absmax1, at::Tensor absmax2, at::Tensor state1, at::Tensor state2,
                       const at::Tensor& qmap1, const at::Tensor& qmap2, const at::Tensor& segments,
                       const at::Tensor& hyper, const std::optional<at::Tensor>& scale,
                       const std::optional<at::Tensor>& error, c10::string_view arithmetic,
                       const std::optional<at::Tensor>& lp_params) {
    const dsbnb::cpu::Checker check("adam8bit_step_");
    const bool bnb_cpu = dsbnb::cpu::bnb_cpu_arithmetic(check, arithmetic);
    dsbnb::cpu::choose_key_lookup(check);
    const double inv_scale = dsbnb::cpu::scale_of(check, scale);
    const dsbnb::Master master = dsbnb::cpu::master_of(check, params, error);
    const dsbnb::cpu::ModelCopy copy = dsbnb::cpu::model_copy_of(check, master, params, lp_params);
    check.expect(codes1, "codes1", at::kByte);
    check.expect(codes2, "codes2", at::kByte);
    check.expect(absmax1, "absmax1", at::kFloat);
    check.expect(absmax2, "absmax2", at::kFloat);
    check.expect(state1, "state1", at::kFloat);
    check.expect(state2, "state2", at::kFloat);
    check.expect(qmap1, "qmap1", at::kFloat);
    check.expect(qmap2, "qmap2", at::kFloat);
    check(qmap1.numel() == 256 && qmap2.numel() == 256, "qmap1 and qmap2 must hold 256 entries");
    const dsbnb::StateSizes states[2] = {{codes1.numel(), absmax1.numel(), state1.numel()},
                                         {codes2.numel(), absmax2.numel(), state2.numel()}};
    const dsbnb::cpu::BlockPlan work =
        dsbnb::cpu::plan_blocks(check, segments, hyper, dsbnb::kHyperFields, params.numel(), states, 2);
    const MapTables& t1 = dsbnb::cpu::tables_for(qmap1);
    const MapTables& t2 = dsbnb::cpu::tables_for(qmap2);
    const float inv = static_cast<float>(inv_scale);
    const auto* h = reinterpret_cast<const Hyper*>(hyper.data_ptr<float>());
    uint8_t *c1 = codes1.data_ptr<uint8_t>(), *c2 = codes2.data_ptr<uint8_t>();
    float *a1 = absmax1.data_ptr<float>(), *a2 = absmax2.data_ptr<float>();
    float *s1 = state1.data_ptr<float>(), *s2 = state2.data_ptr<float>();
    const float *q1 = qmap1.data_ptr<float>(), *q2 = qmap2.data_ptr<float>();
    dsbnb::cpu::dispatch(check, params, grads, inv_scale, [&](auto* g, auto scale) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        constexpr bool kScale = decltype(scale)::value;
        // 'bnb_cpu': the fp32 segments' moments first, then torch's own sqrt of the packed second moments, which is
        // what bnb's update divides by
        const at::Tensor root = bnb_cpu && state2.numel() > 0
                                    ? bnb32_moments<G, kScale>(segments, h, g, s1, s2, state2, inv)
                                    : at::Tensor();
        const float* r = root.defined() ? root.data_ptr<float>() : nullptr;
        dsbnb::cpu::for_each_block(segments, work, [&](const dsbnb::Segment& s, int64_t start, int64_t len,
                                                       int64_t base) {
            if (s.eight_bit) dsbnb::cpu::prefetch_block(master, g, c1, c2, base + kBlock, copy);
            dsbnb::cpu::with_fp32_master(master, copy, base, len, [&](float* p) {
                if (s.eight_bit) {
                    const int64_t block = base / kBlock;
                    block_8bit<G, kScale>(h[s.hyper_row], len, p, g + base, c1 + base, c2 + base, a1 + block,
                                          a2 + block, q1, q2, t1, t2, inv);
                } else if (r != nullptr) {
                    bnb32_params(h[s.hyper_row], len, p, s1 + s.fp32_offset + start, r + s.fp32_offset + start);
                } else {
                    block_fp32<G, kScale>(h[s.hyper_row], len, p, g + base, s1 + s.fp32_offset + start,
                                          s2 + s.fp32_offset + start, inv);
                }
            });
        });
    });
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CPU, m) { m.impl("adam8bit_step_", &adam8bit_step_cpu); }
