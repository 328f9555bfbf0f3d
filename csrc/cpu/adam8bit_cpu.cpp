// adam8bit_cpu.cpp — the C++ CPU implementation of deepspeed_bnb::adam8bit_step_: one fused 8-bit AdamW step over a
// whole ZeRO partition, walking its segment table, parallel over 256-element blocks (ATen's thread pool).
//
// Per block, in one pass: gradient unscale/clip factor, dequantize (qmap[code] * absmax), moments, decoupled weight
// decay and parameter update (fp32 master), optional bf16/fp16 copy, then per-block absmax and requantization to the
// nearest code. Semantics: deepspeed_bnb/ops/reference.py, bit for bit (tests/test_fused_step.py); the arithmetic
// itself lives in csrc/include/dsbnb/adam8bit.h, shared with the CUDA kernel.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (kOptimizerStatic8bit2StateBlockwise), llm.c's AdamW kernels.
// Build: JIT by deepspeed_bnb/ops/loader.py (ninja; cached under TORCH_EXTENSIONS_DIR), or ahead of time with
// `DEEPSPEED_BNB_BUILD_EXT=1 pip install -e .`. Flags that keep it exact: -ffp-contract=off, no -ffast-math.
// Test: pytest tests/test_fused_step.py; speed: python benchmarks/bench_optimizer_step.py.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "adam8bit_avx512.h"
#include "dsbnb/adam8bit.h"

namespace {

using dsbnb::Hyper;
using dsbnb::kBlock;
using dsbnb::QuantTables;
using dsbnb::Segment;

// Everything the kernel derives from one 256-entry map.
struct MapTables {
    QuantTables generic;  // the portable quantizer (any map)
#if DSBNB_AVX512
    dsbnb::avx512::FastTables fast;  // the AVX-512 look-ups (used where fast.usable)
    explicit MapTables(const float* qmap) : generic(qmap), fast(qmap, generic) {}
    bool fast_usable() const { return fast.usable; }
#else
    explicit MapTables(const float* qmap) : generic(qmap) {}
    bool fast_usable() const { return false; }
#endif
};

// The maps are optimizer constants: build their tables once per distinct content.
const MapTables& tables_for(const at::Tensor& qmap) {
    static std::mutex lock;
    static std::vector<std::pair<std::array<float, 256>, std::unique_ptr<MapTables>>> cache;
    std::array<float, 256> key;
    std::memcpy(key.data(), qmap.data_ptr<float>(), sizeof(float) * 256);
    std::lock_guard<std::mutex> guard(lock);
    for (const auto& entry : cache) {
        if (std::memcmp(entry.first.data(), key.data(), sizeof(float) * 256) == 0) return *entry.second;
    }
    cache.emplace_back(key, std::make_unique<MapTables>(key.data()));
    return *cache.back().second;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

struct Work {
    int64_t segment;  // row of the segment table
    int64_t block;    // block index inside the segment
};

inline bool finite(float x) { return std::fabs(x) <= 3.40282347e+38f; }  // false for inf and NaN; vectorizes

// The portable quantizer of one block (any map; vectorized by the compiler, with gathers).
inline void quantize_block(int64_t len, const float* m, const float* v, float r1, float r2, uint8_t* __restrict__ c1,
                           uint8_t* __restrict__ c2, const QuantTables& t1, const QuantTables& t2) {
    if (t1.max_walk <= 1 && t2.max_walk <= 1) {  // bnb's maps: one compare per value, no sorted-index tables
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
            const float u1 = dsbnb::normalize(m[j], r1), u2 = dsbnb::normalize(v[j], r2);
            const uint32_t k1 = dsbnb::lut_key(u1), k2 = dsbnb::lut_key(u2);
            const int32_t pair1 = t1.codes[k1], pair2 = t2.codes[k2];
            c1[j] = static_cast<uint8_t>(t1.split[k1] < u1 ? pair1 >> 8 : pair1 & 0xFF);
            c2[j] = static_cast<uint8_t>(t2.split[k2] < u2 ? pair2 >> 8 : pair2 & 0xFF);
        }
    } else {
        alignas(64) int32_t i1[kBlock], i2[kBlock];
        alignas(64) float u1[kBlock], u2[kBlock];
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
            u1[j] = dsbnb::normalize(m[j], r1);
            u2[j] = dsbnb::normalize(v[j], r2);
            i1[j] = t1.lut[dsbnb::lut_key(u1[j])];
            i2[j] = t2.lut[dsbnb::lut_key(u2[j])];
        }
        for (int k = 0; k < t1.max_walk; ++k) {
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) i1[j] += t1.midpoints[i1[j]] < u1[j] ? 1 : 0;
        }
        for (int k = 0; k < t2.max_walk; ++k) {
#pragma omp simd
            for (int64_t j = 0; j < len; ++j) i2[j] += t2.midpoints[i2[j]] < u2[j] ? 1 : 0;
        }
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
            c1[j] = static_cast<uint8_t>(t1.order[i1[j]]);
            c2[j] = static_cast<uint8_t>(t2.order[i2[j]]);
        }
    }
}

// Per-block absmax of both new moments; a NaN moment makes absmax the first NaN, as torch.amax returns it.
inline void absmax_pair(int64_t len, const float* m, const float* v, float& max1, float& max2) {
    max1 = 0.0f;
    max2 = 0.0f;
    int nan1 = 0, nan2 = 0;
#pragma omp simd reduction(max : max1, max2) reduction(| : nan1, nan2)
    for (int64_t j = 0; j < len; ++j) {
        const float x1 = std::fabs(m[j]), x2 = std::fabs(v[j]);
        max1 = x1 > max1 ? x1 : max1;
        max2 = x2 > max2 ? x2 : max2;
        nan1 |= x1 != x1;
        nan2 |= x2 != x2;
    }
    if (nan1 || nan2) {  // rare
        for (int64_t j = len - 1; j >= 0; --j) {
            const float x1 = std::fabs(m[j]), x2 = std::fabs(v[j]);
            if (x1 != x1) max1 = x1;
            if (x2 != x2) max2 = x2;
        }
    }
}

// The update of one block by portable, compiler-vectorized loops: dequantize, moments, parameter; writes p, m, v.
template <typename GradT, bool Scale>
void update_block(const Hyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                  const uint8_t* __restrict__ c1, const uint8_t* __restrict__ c2, float scale1, float scale2,
                  const float* __restrict__ q1, const float* __restrict__ q2, float inv_scale, float* __restrict__ m,
                  float* __restrict__ v) {
    const Hyper h = hyper;  // a local copy: the compiler need not reload it around stores through p
    alignas(64) float m_old[kBlock], v_old[kBlock], g[kBlock];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {  // gathers and conversions apart: the arithmetic below is contiguous
        m_old[j] = q1[c1[j]] * scale1;
        v_old[j] = q2[c2[j]] * scale2;
        g[j] = Scale ? to_float(g_in[j]) * inv_scale : to_float(g_in[j]);
    }
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        float mm, vv;
        dsbnb::adam_moments(m_old[j], v_old[j], g[j], h, mm, vv);
        const float pn = dsbnb::adam_param(p[j], mm, vv, h);
        const bool ok = finite(g[j]);
        m[j] = ok ? mm : m_old[j];
        v[j] = ok ? vv : v_old[j];
        p[j] = ok ? pn : p[j];
    }
}

#if DSBNB_AVX512
template <typename GradT>
constexpr dsbnb::avx512::Grad grad_kind() {
    return std::is_same<GradT, float>::value            ? dsbnb::avx512::Grad::kFloat32
           : std::is_same<GradT, c10::BFloat16>::value ? dsbnb::avx512::Grad::kBFloat16
                                                        : dsbnb::avx512::Grad::kFloat16;
}
#endif

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
        if (!dsbnb::avx512::update_block<grad_kind<GradT>(), Scale>(hyper, p, g_in, c1, c2, *a1, *a2, t1.fast,
                                                                     t2.fast, inv_scale, m, v, max1, max2)) {
            absmax_pair(len, m, v, max1, max2);  // a NaN moment: the first-NaN rule
        }
        const float r1 = dsbnb::reciprocal(max1), r2 = dsbnb::reciprocal(max2);
        for (int64_t j = 0; j < kBlock; j += 16) {
            dsbnb::avx512::quantize16(t1.fast, m + j, r1, c1 + j);
            dsbnb::avx512::quantize16(t2.fast, v + j, r2, c2 + j);
        }
        *a1 = max1;
        *a2 = max2;
        return;
    }
#endif
    update_block<GradT, Scale>(hyper, len, p, g_in, c1, c2, *a1, *a2, q1, q2, inv_scale, m, v);
    absmax_pair(len, m, v, max1, max2);
    quantize_block(len, m, v, dsbnb::reciprocal(max1), dsbnb::reciprocal(max2), c1, c2, t1.generic, t2.generic);
    *a1 = max1;
    *a2 = max2;
}

template <typename GradT, bool Scale>
void block_fp32(const Hyper& hyper, int64_t len, float* __restrict__ p, const GradT* __restrict__ g_in,
                float* __restrict__ s1, float* __restrict__ s2, float inv_scale) {
    const Hyper h = hyper;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        float g = to_float(g_in[j]);
        if (Scale) g = g * inv_scale;
        float mm, vv;
        dsbnb::adam_moments(s1[j], s2[j], g, h, mm, vv);
        const float pn = dsbnb::adam_param(p[j], mm, vv, h);
        const bool ok = finite(g);
        s1[j] = ok ? mm : s1[j];
        s2[j] = ok ? vv : s2[j];
        p[j] = ok ? pn : p[j];
    }
}

template <typename GradT, typename LowT, bool Scale>
void run(const Segment* segments, const std::vector<Work>& work, const Hyper* hyper, float* params, const GradT* grads,
         uint8_t* codes1, uint8_t* codes2, float* absmax1, float* absmax2, float* state1, float* state2,
         const float* qmap1, const float* qmap2, const MapTables& t1, const MapTables& t2, float inv_scale,
         LowT* low) {
    at::parallel_for(0, static_cast<int64_t>(work.size()), 16, [&](int64_t begin, int64_t end) {
        for (int64_t w = begin; w < end; ++w) {
            const Segment& s = segments[work[w].segment];
            const int64_t start = work[w].block * kBlock;
            const int64_t len = std::min<int64_t>(kBlock, s.numel - start);
            const int64_t base = s.offset + start;
            if (s.eight_bit) {
                const int64_t block = base / kBlock;
                block_8bit<GradT, Scale>(hyper[s.hyper_row], len, params + base, grads + base, codes1 + base,
                                         codes2 + base, absmax1 + block, absmax2 + block, qmap1, qmap2, t1, t2,
                                         inv_scale);
            } else {
                block_fp32<GradT, Scale>(hyper[s.hyper_row], len, params + base, grads + base,
                                         state1 + s.fp32_offset + start, state2 + s.fp32_offset + start, inv_scale);
            }
            if (low != nullptr) {
                for (int64_t j = 0; j < len; ++j) low[base + j] = static_cast<LowT>(params[base + j]);
            }
        }
    });
}

void check(bool ok, const std::string& message) { TORCH_CHECK(ok, "deepspeed_bnb::adam8bit_step_: ", message); }

void expect(const at::Tensor& t, const char* name, at::ScalarType dtype) {
    check(t.device().is_cpu(), std::string(name) + " must be a CPU tensor here (got " + t.device().str() + ")");
    check(t.scalar_type() == dtype,
          std::string(name) + " must be " + c10::toString(dtype) + ", got " + c10::toString(t.scalar_type()));
    check(t.is_contiguous(), std::string(name) + " must be contiguous");
}

void adam8bit_step_cpu(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor codes2,
                       at::Tensor absmax1, at::Tensor absmax2, at::Tensor state1, at::Tensor state2,
                       const at::Tensor& qmap1, const at::Tensor& qmap2, const at::Tensor& segments,
                       const at::Tensor& hyper, double inv_scale, const std::optional<at::Tensor>& lp_params) {
    expect(params, "params", at::kFloat);
    expect(codes1, "codes1", at::kByte);
    expect(codes2, "codes2", at::kByte);
    expect(absmax1, "absmax1", at::kFloat);
    expect(absmax2, "absmax2", at::kFloat);
    expect(state1, "state1", at::kFloat);
    expect(state2, "state2", at::kFloat);
    expect(qmap1, "qmap1", at::kFloat);
    expect(qmap2, "qmap2", at::kFloat);
    expect(segments, "segments", at::kLong);
    expect(hyper, "hyper", at::kFloat);
    check(grads.device().is_cpu() && grads.is_contiguous(), "grads must be a contiguous CPU tensor");
    check(grads.numel() == params.numel(), "grads and params differ in size");
    check(qmap1.numel() == 256 && qmap2.numel() == 256, "qmap1 and qmap2 must hold 256 entries");
    check(segments.dim() == 2 && segments.size(1) == dsbnb::kSegmentFields, "segments must be int64 [S, 5]");
    check(hyper.dim() == 2 && hyper.size(1) == dsbnb::kHyperFields, "hyper must be float32 [H, 7]");
    const int64_t partition = params.numel();
    const auto* table = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
    std::vector<Work> work;
    for (int64_t i = 0; i < segments.size(0); ++i) {
        const Segment& s = table[i];
        const std::string where = "segment " + std::to_string(i) + ": ";
        check(s.offset >= 0 && s.numel > 0 && s.offset + s.numel <= partition && s.offset % kBlock == 0,
              where + "offset/numel outside the partition or not block-aligned");
        check(s.hyper_row >= 0 && s.hyper_row < hyper.size(0), where + "hyper_row outside the hyper table");
        if (s.eight_bit) {
            check(codes1.numel() == partition && codes2.numel() == partition,
                  where + "8-bit segments need codes1/codes2 of the partition's size");
            check(absmax1.numel() * kBlock >= s.offset + s.numel && absmax2.numel() * kBlock >= s.offset + s.numel,
                  where + "absmax1/absmax2 too short");
        } else {
            check(s.fp32_offset >= 0 && s.fp32_offset + s.numel <= state1.numel() &&
                      s.fp32_offset + s.numel <= state2.numel(),
                  where + "fp32_offset/numel outside state1/state2");
        }
        for (int64_t b = 0; b * kBlock < s.numel; ++b) work.push_back({i, b});
    }
    at::Tensor low;
    if (lp_params.has_value()) {
        low = *lp_params;
        check(low.is_contiguous() && low.numel() == partition && low.device().is_cpu(),
              "lp_params must be a contiguous CPU tensor of the partition's size");
        check(low.scalar_type() == at::kBFloat16 || low.scalar_type() == at::kHalf, "lp_params must be bf16 or fp16");
    }
    const MapTables& t1 = tables_for(qmap1);
    const MapTables& t2 = tables_for(qmap2);
    const bool scale = inv_scale != 1.0;
    const float inv = static_cast<float>(inv_scale);
    const auto* h = reinterpret_cast<const Hyper*>(hyper.data_ptr<float>());
    auto dispatch_low = [&](auto* grad_ptr) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(grad_ptr)>>;
        float* p = params.data_ptr<float>();
        uint8_t* c1 = codes1.data_ptr<uint8_t>();
        uint8_t* c2 = codes2.data_ptr<uint8_t>();
        float *a1 = absmax1.data_ptr<float>(), *a2 = absmax2.data_ptr<float>();
        float *s1 = state1.data_ptr<float>(), *s2 = state2.data_ptr<float>();
        const float *q1 = qmap1.data_ptr<float>(), *q2 = qmap2.data_ptr<float>();
        auto go = [&](auto* low_ptr) {
            using L = std::remove_pointer_t<decltype(low_ptr)>;
            if (scale) {
                run<G, L, true>(table, work, h, p, grad_ptr, c1, c2, a1, a2, s1, s2, q1, q2, t1, t2, inv, low_ptr);
            } else {
                run<G, L, false>(table, work, h, p, grad_ptr, c1, c2, a1, a2, s1, s2, q1, q2, t1, t2, inv, low_ptr);
            }
        };
        if (!low.defined()) {
            go(static_cast<float*>(nullptr));
        } else if (low.scalar_type() == at::kBFloat16) {
            go(low.data_ptr<c10::BFloat16>());
        } else {
            go(low.data_ptr<c10::Half>());
        }
    };
    switch (grads.scalar_type()) {
        case at::kFloat: dispatch_low(grads.data_ptr<float>()); break;
        case at::kBFloat16: dispatch_low(grads.data_ptr<c10::BFloat16>()); break;
        case at::kHalf: dispatch_low(grads.data_ptr<c10::Half>()); break;
        default: check(false, std::string("grads must be float32, bfloat16 or float16, got ") +
                                  c10::toString(grads.scalar_type()));
    }
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CPU, m) { m.impl("adam8bit_step_", &adam8bit_step_cpu); }
