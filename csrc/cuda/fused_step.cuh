// fused_step.cuh — the CUDA kernel of every fused rule (AdamW, Lion, SGD-momentum) in either arithmetic: one launch
// steps every segment of a ZeRO partition, 8-bit and 32-bit state alike.
//
// Shape (what makes it memory-bound rather than instruction-bound):
// - a persistent grid (as many thread blocks as fit on the GPU at once) whose warps stride over the partition's
//   256-element quantization blocks; the segment of a block comes from a table built on the host once per segment
//   table (block -> segment, as torch's multi-tensor apply passes its block-to-tensor map), not from a search;
// - each lane owns 8 consecutive elements of its block: 16-byte loads and stores of weights and gradients, 8-byte
//   ones of each state's codes, so a warp moves a block in a handful of wide transactions;
// - the 8-bit quantizer is compact_quantizer.h's table lookup in shared memory (a 6 KB table per map, one compare),
//   proven equal to the searches it replaces for every float;
// - per-block constants (bias corrections) are computed by the warp from the segment's hyper row;
// - full, aligned blocks run a copy of the body compiled for 8 valid elements per lane (Tuning: the launch shape is
//   data, and the GPU proof's part k times the alternatives side by side; on an H200 this copy took the AdamW kernel
//   from 39% to 59% of a device copy's bandwidth); a shape may stage the next block's bytes in shared memory while a
//   block is stepped (staged_loop: cp.async, so a warp's loads stay in flight through its arithmetic).
// Beside fp32 master weights the kernel can also write the model's bf16 copy of them (the operators' lp_params: the
// master kind kFloat32WithBf16Copy, store_model_copy), where DeepSpeed's step otherwise converts the partition after
// it.
// A Rule (*_rules.cuh, launched by adam8bit.cu, lion8bit.cu, momentum8bit.cu) supplies the arithmetic; the two
// arithmetics differ only there and in the quantizer's rounding (Ieee: ties low, NaN-propagating absmax, Adam's
// positive floor; Bnb: bnb's quantize_2D, NaN-dropping absmax, the sign fix, the padding lanes of a partial block as
// bnb's kernel fills them).
// Semantics: "ieee" is deepspeed_bnb/ops/reference.py bit for bit; "bnb_cuda" is bitsandbytes' own CUDA kernels
// (csrc/include/dsbnb/bnb_cuda_math.h). References: torch's multi_tensor_apply.cuh (host-built block map),
// bitsandbytes 0.50.2 csrc/kernels.cu, llm.c's AdamW kernel (vectorized loads).
// Build: nvcc only (no torch headers), with the kernels; tests/kernels/test_cuda_build.py compiles it for sm_80 and
// sm_90. Test: tests/kernels/test_fused_rules.py (ieee, against the reference) and the GPU proof's kernel part
// (bnb_cuda, against bitsandbytes itself) where a GPU is present.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include "adam8bit_launch.h"
#include "dsbnb/bnb_cuda_math.h"
#include "dsbnb/compact_quantizer.h"

namespace dsbnb {
namespace device {

constexpr int kWarps = 8;                 // warps per thread block (256 threads)
constexpr int kPerLane = kBlock / 32;     // elements per lane: 8 consecutive ones
// the code bnb's 8-bit kernels load for a partial block's missing elements: 128 for state 1, 0 for state 2
__device__ __forceinline__ int fill_code(int state) { return state == 0 ? 128 : 0; }

// --- loads and stores of 8 consecutive elements ----------------------------------------------------------------
__device__ __forceinline__ float widen(const void* grads, GradType type, int64_t i) {
    switch (type) {
        case GradType::kBFloat16:
            return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(grads)[i]) << 16);
        case GradType::kFloat16: return __half2float(static_cast<const __half*>(grads)[i]);
        default: return static_cast<const float*>(grads)[i];
    }
}

// 8 halves (bf16 or fp16 bits) from one 16-byte load.
__device__ __forceinline__ void load_halves(const void* base, int64_t i, uint16_t (&h)[8]) {
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        h[2 * k] = static_cast<uint16_t>(w[k] & 0xFFFFu);
        h[2 * k + 1] = static_cast<uint16_t>(w[k] >> 16);
    }
}

__device__ __forceinline__ void store_halves(void* base, int64_t i, const uint16_t (&h)[8]) {
    uint4 v;
    v.x = h[0] | (static_cast<uint32_t>(h[1]) << 16);
    v.y = h[2] | (static_cast<uint32_t>(h[3]) << 16);
    v.z = h[4] | (static_cast<uint32_t>(h[5]) << 16);
    v.w = h[6] | (static_cast<uint32_t>(h[7]) << 16);
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = v;
}

__device__ __forceinline__ void load_bytes(const void* base, int64_t i, uint8_t (&b)[8]) {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(base) + i);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        b[k] = static_cast<uint8_t>(v.x >> (8 * k));
        b[4 + k] = static_cast<uint8_t>(v.y >> (8 * k));
    }
}

__device__ __forceinline__ void store_bytes(void* base, int64_t i, const uint8_t (&b)[8]) {
    uint2 v;
    v.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    v.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(base) + i) = v;
}

// The gradients of elements i..i+7 as fp32 (bf16 and fp16 widened exactly); n of them valid (the rest 0).
__device__ __forceinline__ void load_grads(const void* grads, GradType type, int64_t i, int n, bool vec,
                                           float (&g)[8]) {
    if (vec && n == 8) {
        if (type == GradType::kFloat32) {
            const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(grads) + i);
            const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(grads) + i + 4);
            g[0] = a.x; g[1] = a.y; g[2] = a.z; g[3] = a.w; g[4] = b.x; g[5] = b.y; g[6] = b.z; g[7] = b.w;
            return;
        }
        uint16_t h[8];
        load_halves(grads, i, h);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            g[k] = type == GradType::kBFloat16 ? __uint_as_float(static_cast<uint32_t>(h[k]) << 16)
                                               : __half2float(__ushort_as_half(h[k]));
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = k < n ? widen(grads, type, i + k) : 0.0f;
}

// Master weights of elements i..i+7 as fp32 (K: the kind, a template argument so each kind is its own code).
template <MasterKind K>
__device__ __forceinline__ void load_weights(const Master& m, int64_t i, int n, bool vec, float (&p)[8]) {
    if (vec && n == 8) {
        if (fp32_values(K)) {
            const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(m.values) + i);
            const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(m.values) + i + 4);
            p[0] = a.x; p[1] = a.y; p[2] = a.z; p[3] = a.w; p[4] = b.x; p[5] = b.y; p[6] = b.z; p[7] = b.w;
            return;
        }
        uint16_t h[8];
        load_halves(m.values, i, h);
        if (K == MasterKind::kBFloat16) {
#pragma unroll
            for (int k = 0; k < 8; ++k) p[k] = bf16_value(h[k]);
            return;
        }
        uint8_t e[8];
        load_bytes(m.error, i, e);
#pragma unroll
        for (int k = 0; k < 8; ++k) p[k] = join(h[k], static_cast<int8_t>(e[k]));
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k >= n) {
            p[k] = 0.0f;
        } else if (fp32_values(K)) {
            p[k] = static_cast<const float*>(m.values)[i + k];
        } else if (K == MasterKind::kBFloat16) {
            p[k] = bf16_value(static_cast<const uint16_t*>(m.values)[i + k]);
        } else {
            p[k] = join(static_cast<const uint16_t*>(m.values)[i + k], m.error[i + k]);
        }
    }
}

// bf16 or compensated master weights of elements i..i+7 from their fp32 values (see store_weights).
template <MasterKind K, bool ExactBf16>
__device__ __forceinline__ void store_halves_of(const Master& m, int64_t i, int n, bool vec, const float (&p)[8]) {
    uint16_t h[8];
    int8_t e[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (K == MasterKind::kBFloat16) {
            h[k] = ExactBf16 ? static_cast<uint16_t>(__float_as_uint(p[k]) >> 16) : bf16_round(p[k]);
        } else {
            split(p[k], h[k], e[k]);
        }
    }
    if (vec && n == 8) {
        store_halves(m.values, i, h);
        if (K == MasterKind::kCompensated) store_bytes(m.error, i, reinterpret_cast<const uint8_t(&)[8]>(e));
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k < n) {
            static_cast<uint16_t*>(m.values)[i + k] = h[k];
            if (K == MasterKind::kCompensated) m.error[i + k] = e[k];
        }
    }
}

// The model's bf16 copy of fp32 weights i..i+7 (kFloat32WithBf16Copy): torch's own CUDA conversion, which is what
// DeepSpeed's copy of the partition after the step writes (c10::BFloat16 from float on sm_80 and later is
// __float2bfloat16: round to nearest even, a NaN as cvt.rn.bf16.f32 canonicalizes it).
__device__ __forceinline__ void store_model_copy(uint16_t* copy, int64_t i, int n, bool vec, const float (&p)[8]) {
    uint16_t h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = __bfloat16_as_ushort(__float2bfloat16_rn(p[k]));
    if (vec && n == 8) {
        store_halves(copy, i, h);
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k < n) copy[i + k] = h[k];
    }
}

// Stores updated master weights (and, for kFloat32WithBf16Copy, the model's copy of them). `exact_bf16`: bf16 values
// already rounded by the rule (bnb's bf16 kernels round where bnb rounds; storing the top half keeps a NaN's bits as
// bnb's conversion made them).
template <MasterKind K, bool ExactBf16>
__device__ __forceinline__ void store_weights(const Master& m, int64_t i, int n, bool vec, const float (&p)[8]) {
    if (fp32_values(K)) {
        if (vec && n == 8) {
            *reinterpret_cast<float4*>(static_cast<float*>(m.values) + i) = make_float4(p[0], p[1], p[2], p[3]);
            *reinterpret_cast<float4*>(static_cast<float*>(m.values) + i + 4) = make_float4(p[4], p[5], p[6], p[7]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (k < n) static_cast<float*>(m.values)[i + k] = p[k];
            }
        }
        if (K == MasterKind::kFloat32WithBf16Copy) store_model_copy(m.copy, i, n, vec, p);
    } else {
        store_halves_of<K, ExactBf16>(m, i, n, vec, p);
    }
}

// DeepSpeed's unscale/clip factor, applied as its grad.mul_ would have: an fp32 product for fp32 gradients; for
// bf16 and fp16 ones the product rounded back to the gradient's dtype (torch computes in fp32 and stores the
// gradient's dtype), the factor first rounded to that dtype when it was a device tensor (TensorIterator casts a
// non-CPU-scalar operand to the common dtype). Ieee: the reference's fp32 product, for every dtype.
template <bool Bnb>
__device__ __forceinline__ float unscale(float g, GradType type, const Scale& s) {
    if (!s.present) return g;
    if (!Bnb || type == GradType::kFloat32) return __fmul_rn(g, s.value);
    if (type == GradType::kBFloat16) {
        const float f = s.on_device ? __bfloat162float(__float2bfloat16_rn(s.value)) : s.value;
        return __bfloat162float(__float2bfloat16_rn(__fmul_rn(g, f)));
    }
    const float f = s.on_device ? __half2float(__float2half_rn(s.value)) : s.value;
    return __half2float(__float2half_rn(__fmul_rn(g, f)));
}

// unscale() of 8 gradients of dtype T by a factor present, from the device or not (OnDevice): every choice unscale()
// makes known when compiled, so the loop has none.
template <bool Bnb, GradType T, bool OnDevice>
__device__ __forceinline__ void unscale_known(float (&g)[8], float value) {
    const Scale known{true, OnDevice, value, nullptr};
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] = unscale<Bnb>(g[k], T, known);
}

// unscale() of a lane's 8 gradients. Selects: the choices (a factor at all, the gradient's dtype, the factor's
// origin) made once for the 8 (per element each compiles to branches of the element's own); the same products.
template <bool Bnb, bool Selects>
__device__ __forceinline__ void unscale_lane(float (&g)[8], GradType type, const Scale& s) {
    if (!Selects) {
#pragma unroll
        for (int k = 0; k < 8; ++k) g[k] = unscale<Bnb>(g[k], type, s);
        return;
    }
    if (!s.present) return;
    switch (type) {
        case GradType::kBFloat16:
            return s.on_device ? unscale_known<Bnb, GradType::kBFloat16, true>(g, s.value)
                               : unscale_known<Bnb, GradType::kBFloat16, false>(g, s.value);
        case GradType::kFloat16:
            return s.on_device ? unscale_known<Bnb, GradType::kFloat16, true>(g, s.value)
                               : unscale_known<Bnb, GradType::kFloat16, false>(g, s.value);
        default:  // an fp32 product, wherever the factor came from
            return unscale_known<Bnb, GradType::kFloat32, false>(g, s.value);
    }
}

// --- the quantizer tables of one map, in shared memory ---------------------------------------------------------
struct MapSmem {
    float q[256];                           // the map (dequantization; bnb's literal search)
    float mid[256];                         // midpoints of the sorted map (+ a NaN sentinel)
    uint8_t order[256];                     // code of each sorted entry
    uint8_t lo[compact::kMaxKeys];          // the compact table (fast maps)
    int negatives;                          // entries with the sign bit set: in a sorted map the first ones (filled
                                            // by the kernels whose shape has Selects, for their sign fix)
};

// Negatives: also count the map's entries with the sign bit set (every thread of the block calls this).
template <bool Negatives = false>
__device__ __forceinline__ void fill_map(MapSmem& s, const float* qmap, const DeviceTables& t) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        s.q[i] = qmap[i];
        s.mid[i] = t.midpoints[i];
        s.order[i] = t.order[i];
    }
    if (t.fast) {
        for (int i = threadIdx.x; i < t.entries; i += blockDim.x) s.lo[i] = t.lo[i];
    }
    if (Negatives) {  // one block-wide count (the block has 256 threads, one per entry)
        const int count = __syncthreads_count(threadIdx.x < 256 && (__float_as_uint(qmap[threadIdx.x]) >> 31) != 0);
        if (threadIdx.x == 0) s.negatives = count;
    }
}

// The stored code of a state value under the Ieee rules: normalize (NaN and inf*0 as the reference says), nearest
// sorted entry with ties low, its code, and Adam's positive floor. FastOnly: the caller knows the compact table
// applies (fast_maps), so the search is not compiled in. Selects: as quantize_bnb's (the floor a select).
template <bool FastOnly = false, bool Selects = false>
__device__ __forceinline__ uint8_t quantize_ieee(float s, float r, const MapSmem& m, const DeviceTables& t,
                                                  bool floor) {
    const float u = normalize(s, r);
    int index;
    if (FastOnly || t.fast) {
        index = compact::nearest<compact::kTiesLow>(u, m.lo, m.mid, t.e_lo, t.span);
    } else {  // count of midpoints strictly below u (m.mid[255] is a NaN sentinel: never below)
        index = 0;
#pragma unroll
        for (int step = 128; step > 0; step >>= 1) index += (m.mid[index + step - 1] < u) ? step : 0;
    }
    const uint8_t code = m.order[index];
    if (Selects) {
        return static_cast<uint8_t>(bnbmath::pick(floor, static_cast<uint32_t>(floor_positive(code, s, t.floor)),
                                                  static_cast<uint32_t>(code)));
    }
    return floor ? floor_positive(code, s, t.floor) : code;
}

// The stored code under bnb's rules: u = s * rcp(absmax) with flush-to-zero, quantize_2D (ties to the even sorted
// index, NaN to 0), and the sign fix of signed states. FastOnly: as quantize_ieee's. Selects: the compact table's
// entry is looked up for a NaN u too (entry_of puts it in the "huge" bucket, in bounds) and 0 selected after, and the
// sign fix is a select, so no element's code is a branch of its own; with a sorted map the sign fix reads the code's
// sign off its index (sign_fix_sorted), one shared-memory load fewer per element.
template <bool FastOnly = false, bool Selects = false>
__device__ __forceinline__ uint8_t quantize_bnb(float s, float r, const MapSmem& m, const DeviceTables& t,
                                                 bool is_signed) {
    const float u = bnbmath::mul(r, s);
    if (Selects && (FastOnly || (t.fast && t.sorted))) {  // a sorted map: the code is the sorted index
        const uint32_t nearest = compact::nearest<compact::kTiesEven>(u, m.lo, m.mid, t.e_lo, t.span);
        const uint8_t code = static_cast<uint8_t>(bnbmath::pick(u != u, 0u, nearest));
        return is_signed ? bnbmath::sign_fix_sorted(code, s, m.negatives) : code;
    }
    int code;
    if (u != u) {
        code = 0;
    } else if (FastOnly || (t.fast && t.sorted)) {
        code = compact::nearest<compact::kTiesEven>(u, m.lo, m.mid, t.e_lo, t.span);
    } else {
        code = compact::bnb_quantize_2d(m.q, is_signed, u);
    }
    return is_signed ? bnbmath::sign_fix<Selects>(static_cast<uint8_t>(code), s, m.q) : static_cast<uint8_t>(code);
}

// --- the kernel ----------------------------------------------------------------------------------------------------
// The launch shape: what benchmarks/kernel_variants/ varies (the GPU proof's part k holds every variant to bnb's own
// update bit for bit and times them side by side); the kernels' own builds compile each rule's Rule::Shape only.
template <int MinBlocks, bool SplitFull, bool PrefetchSegment, int BlocksPerStep = 1, bool FastMaps = false,
          bool Staged = false, bool Selects = false>
struct Tuning {
    static constexpr int kMinBlocks = MinBlocks;   // thread blocks per SM the register budget must allow
    static constexpr bool kSplitFull = SplitFull;  // full, aligned blocks run a copy of the body compiled for 8
                                                   // valid elements per lane (no per-element bounds checks)
    static constexpr bool kPrefetchSegment = PrefetchSegment;  // the next block's segment index is loaded before
                                                               // this block is stepped (one dependent load hidden)
    static constexpr int kBlocksPerStep = BlocksPerStep;  // a warp steps this many full 8-bit blocks at once: their
                                                          // loads issued together, their arithmetic interleaved
    static constexpr bool kFastMaps = FastMaps;  // a kernel whose quantizer is the compact table alone, launched when
                                                 // every map has one (bnb's dynamic maps do; others get `Generic`)
    static constexpr bool kStaged = Staged;  // the next full 8-bit block's bytes are copied into shared memory
                                             // (cp.async) while this one is stepped: see staged_loop
    static constexpr bool kSelects = Selects;  // each element's data-dependent choices (a non-finite gradient, a NaN
                                               // state, the sign fix) are selects, not branches: a branch per element
                                               // makes each element's dependent chain (shared-memory loads, MUFU) a
                                               // basic block of its own, which the compiler cannot interleave with
                                               // the lane's other 7; the same values are selected either way
    static_assert(BlocksPerStep == 1 || (SplitFull && !PrefetchSegment), "blocks stepped together: the full-block "
                  "body, without the index loaded ahead");
    static_assert(!Staged || (SplitFull && !PrefetchSegment && BlocksPerStep == 1), "the staged loop: the full-block "
                  "body, one block per step; it locates the next block itself");
    using Generic = Tuning<MinBlocks, SplitFull, PrefetchSegment, BlocksPerStep, false, Staged, Selects>;
};
// The shape each rule's product kernels compile (Rule::Shape, named in its *_rules.cuh for both arithmetics) is read
// off part k: the fastest shape equal to bnb's update there. Measured on an H200
// (benchmarks/results/gpu/2026-11-28-h200-kernels, part k; 256M elements, fp32 master weights): the full-block body
// moves 59% / 63% / 72% of a copy's bandwidth for AdamW / Lion / SGD-momentum against 39% / 48% / 55% for one body with
// per-element bounds checks; more blocks per SM or the index loaded ahead changed a rule by a few percent, in
// different directions per rule.
using FullBlockBody = Tuning<3, true, false>;
// A build may give every rule's product kernels one candidate shape instead (-DDSBNB_CUDA_SHAPE=DIGITS, Tuning's seven
// arguments as digits, true 1 and false 0: deepspeed_bnb/ops/build_flags.py, cuda_shape_flags, from
// DEEPSPEED_BNB_CUDA_SHAPE), so that the GPU proof's parts measure it before a rule names it. The launch-shape sweep
// (benchmarks/kernel_variants/) is built without it.
template <long Digits>
using ShapeOfDigits = Tuning<Digits / 1000000 % 10, Digits / 100000 % 10 != 0, Digits / 10000 % 10 != 0,
                             Digits / 1000 % 10, Digits / 100 % 10 != 0, Digits / 10 % 10 != 0, Digits % 10 != 0>;
// Variadic, so that a rule may name a Tuning<...> itself: its commas would split a one-argument macro's argument.
#ifdef DSBNB_CUDA_SHAPE
#define DSBNB_PRODUCT_SHAPE(...) device::ShapeOfDigits<DSBNB_CUDA_SHAPE>
#else
#define DSBNB_PRODUCT_SHAPE(...) __VA_ARGS__
#endif

// The 8-bit part of one block's step once its inputs are in registers (p: master weights, g: gradients unscaled,
// codes and absmax_old: the states as stored; i: the lane's first element, n of its 8 valid, vec: wide accesses):
// dequantize, update, store the weights, the new absmax (with the padding lanes bnb's kernel steps in a partial
// block), requantize and store the codes. step_block loads the inputs from global memory, the staged loop
// (Tuning::kStaged) from their copies in shared memory.
template <typename Rule, MasterKind K, bool Full, typename Tune>
__device__ __forceinline__ void finish_8bit(const StepArgs& a, const MapSmem (&maps)[Rule::kStates],
                                            const typename Rule::Consts& c, int64_t i, int64_t block, int n, bool vec,
                                            int len, int lane, float (&p)[8], float (&g)[8],
                                            uint8_t (&codes)[Rule::kStates][8],
                                            const float (&absmax_old)[Rule::kStates]) {
    constexpr int S = Rule::kStates;
    constexpr bool kBnb = Rule::kBnb;
    constexpr bool kBf16 = K == MasterKind::kBFloat16;  // bnb's T = bf16 kernel
    constexpr bool kFastMaps = Tune::kFastMaps, kSelects = Tune::kSelects;
    float s[S][8], best[S];
#pragma unroll
    for (int j = 0; j < S; ++j) best[j] = kBnb ? bnbmath::kMinusFltMax : 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        if (k >= n) continue;
#pragma unroll
        for (int j = 0; j < S; ++j) s[j][k] = Rule::dequantize(maps[j].q[codes[j][k]], absmax_old[j]);
        Rule::template update8<kBf16, kSelects>(c, p[k], g[k], s, k);
#pragma unroll
        for (int j = 0; j < S; ++j) best[j] = Rule::absmax_merge(best[j], s[j][k]);
    }
    store_weights<K, kBnb && kBf16>(a.params, i, n, vec, p);
    if (kBnb && !Full && len < kBlock && lane == 31) {
        // bnb's kernel steps the missing elements of a partial block too (g = 0, codes 128 and 0, p = 0), and
        // their states enter its absmax
        float pad_s[S][8], pad_p = 0.0f;
#pragma unroll
        for (int j = 0; j < S; ++j) pad_s[j][0] = Rule::dequantize(maps[j].q[fill_code(j)], absmax_old[j]);
        Rule::template update8<kBf16>(c, pad_p, 0.0f, pad_s, 0);
#pragma unroll
        for (int j = 0; j < S; ++j) best[j] = Rule::absmax_merge(best[j], pad_s[j][0]);
    }
#pragma unroll
    for (int j = 0; j < S; ++j) {
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            best[j] = Rule::absmax_reduce(best[j], __shfl_xor_sync(0xFFFFFFFFu, best[j], offset));
        }
    }
    if (lane == 0) {  // every lane has read absmax_old (its caller) before this write
#pragma unroll
        for (int j = 0; j < S; ++j) a.absmax[j][block] = best[j];
    }
#pragma unroll
    for (int j = 0; j < S; ++j) {
        const float r = kBnb ? bnbmath::rcp(best[j]) : reciprocal(best[j]);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k < n) {
                codes[j][k] = kBnb ? quantize_bnb<kFastMaps, kSelects>(s[j][k], r, maps[j], a.tables[j], j == 0)
                                   : quantize_ieee<kFastMaps, kSelects>(s[j][k], r, maps[j], a.tables[j],
                                                                        Rule::kFloor && j == 1);
            }
        }
        if (vec) {
            store_bytes(a.codes[j], i, codes[j]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                if (k < n) a.codes[j][i + k] = codes[j][k];
            }
        }
    }
}

// One 256-element block (`start` within segment `seg`, `len` of its elements valid) stepped by one warp. Full: the
// caller knows len == kBlock and every array aligned, so each lane's 8 elements are valid and use wide accesses.
// Rule: kStates (1 or 2), kBnb (which arithmetic), Consts and prepare(row pointer), and per element
// update8(c, p, g, s) (s: dequantized old states in, new ones out) and update32(c, p, g, s, slot) (the fp32 state
// path; slot = index in the segment mod 4); for Ieee, kFloor (Adam's second moment floored). A non-finite gradient
// is the rule's to handle (Ieee keeps p and state; bnb's kernels differ per rule).
template <typename Rule, MasterKind K, bool Full, typename Tune>
__device__ __forceinline__ void step_block(const StepArgs& a, const MapSmem (&maps)[Rule::kStates],
                                           const Scale& scale, const Segment& seg, int64_t start, int len,
                                           int lane) {
    constexpr int S = Rule::kStates;
    constexpr bool kBnb = Rule::kBnb;
    constexpr bool kBf16 = K == MasterKind::kBFloat16;  // bnb's T = bf16 kernel
    const typename Rule::Consts c = Rule::prepare(a.hyper + seg.hyper_row * a.hyper_fields);
    const int first = lane * kPerLane;
    const int n = Full ? kPerLane : max(0, min(kPerLane, len - first));  // this lane's valid elements
    const int64_t i = seg.offset + start + first;                          // its first element in the partition
    const bool vec = Full || (a.aligned && len == kBlock);

    float p[8], g[8];
    load_weights<K>(a.params, i, n, vec, p);
    load_grads(a.grads, a.grad_type, i, n, vec, g);
    unscale_lane<kBnb, Tune::kSelects>(g, a.grad_type, scale);

    if (!seg.eight_bit) {  // 32-bit state: fp32 arrays packed in segment order
        float s[S][8];
        const int64_t f = seg.fp32_offset + start + first;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k < n) {
#pragma unroll
                for (int j = 0; j < S; ++j) s[j][k] = a.state[j][f + k];
                Rule::template update32<kBf16>(c, p[k], g[k], s, k, first + k);
#pragma unroll
                for (int j = 0; j < S; ++j) a.state[j][f + k] = s[j][k];
            }
        }
        store_weights<K, kBnb && kBf16>(a.params, i, n, false, p);
        return;
    }

    const int64_t block = (seg.offset + start) / kBlock;
    float absmax_old[S];
    uint8_t codes[S][8];
#pragma unroll
    for (int j = 0; j < S; ++j) {
        absmax_old[j] = a.absmax[j][block];
        if (vec) {
            load_bytes(a.codes[j], i, codes[j]);
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) codes[j][k] = k < n ? a.codes[j][i + k] : 0;
        }
    }
    finish_8bit<Rule, K, Full, Tune>(a, maps, c, i, block, n, vec, len, lane, p, g, codes, absmax_old);
}

// B full, aligned 8-bit blocks stepped by one warp at once (Tuning::kBlocksPerStep): step_block's full-block body
// with every array widened by a leading [B], so the blocks' loads are in flight together and their arithmetic
// interleaves (the warp's instruction-level parallelism, where one block's dependencies stall it).
template <typename Rule, MasterKind K, typename Tune>
__device__ __forceinline__ void step_full_blocks(const StepArgs& a, const MapSmem (&maps)[Rule::kStates],
                                                 const Scale& scale, const Segment (&seg)[Tune::kBlocksPerStep],
                                                 const int64_t (&start)[Tune::kBlocksPerStep], int lane) {
    constexpr int B = Tune::kBlocksPerStep;
    constexpr bool kFastMaps = Tune::kFastMaps, kSelects = Tune::kSelects;
    constexpr int S = Rule::kStates;
    constexpr bool kBnb = Rule::kBnb;
    constexpr bool kBf16 = K == MasterKind::kBFloat16;
    const int first = lane * kPerLane;
    typename Rule::Consts c[B];
    int64_t i[B], block[B];
    float p[B][8], g[B][8], s[B][S][8], absmax_old[B][S], best[B][S];
    uint8_t codes[B][S][8];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        c[b] = Rule::prepare(a.hyper + seg[b].hyper_row * a.hyper_fields);
        i[b] = seg[b].offset + start[b] + first;
        block[b] = (seg[b].offset + start[b]) / kBlock;
        load_weights<K>(a.params, i[b], kPerLane, true, p[b]);
        load_grads(a.grads, a.grad_type, i[b], kPerLane, true, g[b]);
        unscale_lane<kBnb, kSelects>(g[b], a.grad_type, scale);
#pragma unroll
        for (int j = 0; j < S; ++j) {
            absmax_old[b][j] = a.absmax[j][block[b]];
            load_bytes(a.codes[j], i[b], codes[b][j]);
            best[b][j] = kBnb ? bnbmath::kMinusFltMax : 0.0f;
        }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
#pragma unroll
            for (int j = 0; j < S; ++j) s[b][j][k] = Rule::dequantize(maps[j].q[codes[b][j][k]], absmax_old[b][j]);
            Rule::template update8<kBf16, kSelects>(c[b], p[b][k], g[b][k], s[b], k);
#pragma unroll
            for (int j = 0; j < S; ++j) best[b][j] = Rule::absmax_merge(best[b][j], s[b][j][k]);
        }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) store_weights<K, kBnb && kBf16>(a.params, i[b], kPerLane, true, p[b]);
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int j = 0; j < S; ++j) {
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) {
                best[b][j] = Rule::absmax_reduce(best[b][j], __shfl_xor_sync(0xFFFFFFFFu, best[b][j], offset));
            }
        }
    }
    if (lane == 0) {  // every lane has read absmax_old (above) before this write
#pragma unroll
        for (int b = 0; b < B; ++b) {
#pragma unroll
            for (int j = 0; j < S; ++j) a.absmax[j][block[b]] = best[b][j];
        }
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
#pragma unroll
        for (int j = 0; j < S; ++j) {
            const float r = kBnb ? bnbmath::rcp(best[b][j]) : reciprocal(best[b][j]);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                codes[b][j][k] = kBnb ? quantize_bnb<kFastMaps, kSelects>(s[b][j][k], r, maps[j], a.tables[j], j == 0)
                                      : quantize_ieee<kFastMaps, kSelects>(s[b][j][k], r, maps[j], a.tables[j],
                                                                           Rule::kFloor && j == 1);
            }
            store_bytes(a.codes[j], i[b], codes[b][j]);
        }
    }
}

// The segment of work item `work` and its block's first element in it and valid length.
__device__ __forceinline__ void locate(const StepArgs& a, int64_t work, int32_t index, Segment& seg, int64_t& start,
                                       int& len) {
    seg = a.segments[index];
    start = (work - a.block_starts[index]) * kBlock;
    len = static_cast<int>(min(static_cast<int64_t>(kBlock), seg.numel - start));
}

// One block by step_block: the full-block body where the shape has one and the block is full and aligned.
template <typename Rule, MasterKind K, typename Tune>
__device__ __forceinline__ void step_one(const StepArgs& a, const MapSmem (&maps)[Rule::kStates], const Scale& scale,
                                         const Segment& seg, int64_t start, int len, int lane) {
    if (Tune::kSplitFull && a.aligned && len == kBlock) {
        step_block<Rule, K, true, Tune>(a, maps, scale, seg, start, len, lane);
    } else {
        step_block<Rule, K, false, Tune>(a, maps, scale, seg, start, len, lane);
    }
}

// Steps work items work, work + stride, ... (kBlocksPerStep of them, those below the total): together where every
// one is a full, aligned 8-bit block, one by one otherwise.
template <typename Rule, MasterKind K, typename Tune>
__device__ __forceinline__ void step_work(const StepArgs& a, const MapSmem (&maps)[Rule::kStates], const Scale& scale,
                                          int64_t work, int64_t stride, int lane) {
    constexpr int B = Tune::kBlocksPerStep;
    Segment seg[B];
    int64_t start[B];
    int len[B];
    bool together = a.aligned;
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int64_t item = work + b * stride;
        if (item < a.total_blocks) {
            locate(a, item, a.block_segment[item], seg[b], start[b], len[b]);
            together = together && len[b] == kBlock && seg[b].eight_bit;
        } else {
            len[b] = 0;
            together = false;
        }
    }
    if (together) {
        step_full_blocks<Rule, K, Tune>(a, maps, scale, seg, start, lane);
        return;
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
        if (work + b * stride < a.total_blocks) step_one<Rule, K, Tune>(a, maps, scale, seg[b], start[b], len[b], lane);
    }
}

// --- the staged loop (Tuning::kStaged) -------------------------------------------------------------------------
// A warp's loads are otherwise in flight only between its blocks: it waits for a block's bytes, then computes with
// none outstanding. Here, while a warp steps one full 8-bit block, the next one's weights, gradients and codes travel
// into shared memory by cp.async (no registers held, no wait), the pattern of CUTLASS's multistage main loops. Each
// lane copies, and later reads back, its own bytes only: no barrier, only the lane's own wait (cp.async.wait_group).
// Two slots per lane: one being filled while the other is read. Other blocks (partial, 32-bit state, unaligned
// arrays) are stepped from global memory as step_one does. The arithmetic is finish_8bit's, so the codes, scales and
// weights are those of the other shapes bit for bit.
// References: CUDA C++ Programming Guide, "Asynchronous Data Copies" (__pipeline_memcpy_async); CUTLASS's sm80
// multistage GEMM main loop.
constexpr int kSlotBytes = 80;  // per lane and slot: [0, 32) weights (fp32; bf16 halves; compensated halves with the
                                // error bytes at 16), [32, 64) gradients (fp32 or halves), [64, 64 + 8 S) codes per
                                // state; slots 80 bytes apart keep 8 lanes' 16-byte reads on distinct banks
constexpr int kStagedBytes = kWarps * 2 * 32 * kSlotBytes;  // dynamic shared memory per thread block (40 KiB)

template <typename Tune>
constexpr int dynamic_shared_bytes() {
    return Tune::kStaged ? kStagedBytes : 0;
}

// Starts the copies of one lane's 8 elements (from element i) of a full, aligned 8-bit block into `slot`.
template <MasterKind K, int S>
__device__ __forceinline__ void stage_block(const StepArgs& a, int64_t i, uint8_t* slot) {
    if (fp32_values(K)) {
        const float* w = static_cast<const float*>(a.params.values) + i;
        __pipeline_memcpy_async(slot, w, 16);
        __pipeline_memcpy_async(slot + 16, w + 4, 16);
    } else {
        __pipeline_memcpy_async(slot, static_cast<const uint16_t*>(a.params.values) + i, 16);
        if (K == MasterKind::kCompensated) __pipeline_memcpy_async(slot + 16, a.params.error + i, 8);
    }
    if (a.grad_type == GradType::kFloat32) {
        const float* g = static_cast<const float*>(a.grads) + i;
        __pipeline_memcpy_async(slot + 32, g, 16);
        __pipeline_memcpy_async(slot + 48, g + 4, 16);
    } else {
        __pipeline_memcpy_async(slot + 32, static_cast<const uint16_t*>(a.grads) + i, 16);
    }
#pragma unroll
    for (int j = 0; j < S; ++j) __pipeline_memcpy_async(slot + 64 + 8 * j, a.codes[j] + i, 8);
}

// One full, aligned 8-bit block (its first element `first` in the partition, hyper row `row`) from the lane's staged
// bytes; `absmax_old`: its scales, loaded with them.
template <typename Rule, MasterKind K, typename Tune>
__device__ __forceinline__ void step_staged(const StepArgs& a, const MapSmem (&maps)[Rule::kStates],
                                            const Scale& scale, int64_t first, int64_t row, int lane, uint8_t* slot,
                                            const float (&absmax_old)[Rule::kStates]) {
    constexpr int S = Rule::kStates;
    const typename Rule::Consts c = Rule::prepare(a.hyper + row * a.hyper_fields);
    const Master staged{a.params.kind, slot, reinterpret_cast<int8_t*>(slot + 16)};
    float p[8], g[8];
    load_weights<K>(staged, 0, kPerLane, true, p);
    load_grads(slot + 32, a.grad_type, 0, kPerLane, true, g);
    unscale_lane<Rule::kBnb, Tune::kSelects>(g, a.grad_type, scale);
    uint8_t codes[S][8];
#pragma unroll
    for (int j = 0; j < S; ++j) load_bytes(slot + 64 + 8 * j, 0, codes[j]);
    finish_8bit<Rule, K, true, Tune>(a, maps, c, first + lane * kPerLane, first / kBlock, kPerLane, true, kBlock,
                                         lane, p, g, codes, absmax_old);
}

// What a warp keeps of its next work item in the staged loop (few registers: a block that is not staged is located
// again when it is stepped).
template <int S>
struct StagedItem {
    int64_t first;    // its block's first element in the partition
    int32_t segment;  // its segment's index
    int32_t row;      // its segment's hyper row
    bool staged;      // a full, aligned 8-bit block whose bytes are (being) copied into the lane's slot
    float absmax[S];  // its block's scales before the step (staged blocks)
};

// Locates work item `item` and, for a full aligned 8-bit block, starts its copies into `slot`; one commit group
// per item (empty for the others), so that waiting for all but the newest group waits for the item before it.
template <MasterKind K, int S>
__device__ __forceinline__ void fetch_item(const StepArgs& a, int64_t item, int lane, uint8_t* slot,
                                           StagedItem<S>& it) {
    Segment seg;
    int64_t start;
    int len;
    it.segment = a.block_segment[item];
    locate(a, item, it.segment, seg, start, len);
    it.first = seg.offset + start;
    it.row = static_cast<int32_t>(seg.hyper_row);
    it.staged = a.aligned && len == kBlock && seg.eight_bit;
    if (it.staged) {
        stage_block<K, S>(a, it.first + lane * kPerLane, slot);
#pragma unroll
        for (int j = 0; j < S; ++j) it.absmax[j] = a.absmax[j][it.first / kBlock];
    }
    __pipeline_commit();
}

// Work items work, work + warps, ...: item n + 1's bytes copied while item n is stepped. `slots`: the warp's two
// slots per lane (2 x 32 x kSlotBytes).
template <typename Rule, MasterKind K, typename Tune>
__device__ __forceinline__ void staged_loop(const StepArgs& a, const MapSmem (&maps)[Rule::kStates],
                                            const Scale& scale, int64_t work, int64_t warps, int lane,
                                            uint8_t* slots) {
    constexpr int S = Rule::kStates;
    if (work >= a.total_blocks) return;
    uint8_t* const mine = slots + lane * kSlotBytes;  // slot f of the lane: mine + f * 32 * kSlotBytes
    StagedItem<S> now, next;
    next.staged = false;
    fetch_item<K, S>(a, work, lane, mine, now);
    for (int filling = 1; work < a.total_blocks; work += warps, filling ^= 1) {
        if (work + warps < a.total_blocks) {
            fetch_item<K, S>(a, work + warps, lane, mine + filling * 32 * kSlotBytes, next);
        } else {
            __pipeline_commit();  // an empty group: the wait below still means "the current item's copies"
        }
        __pipeline_wait_prior(1);
        // the wait's asm declares no memory effect: without this fence the compiler may load the slot before it
        asm volatile("" ::: "memory");
        if (now.staged) {
            step_staged<Rule, K, Tune>(a, maps, scale, now.first, now.row, lane,
                                                  mine + (filling ^ 1) * 32 * kSlotBytes, now.absmax);
        } else {
            Segment seg;
            int64_t start;
            int len;
            locate(a, work, now.segment, seg, start, len);
            step_one<Rule, K, Tune>(a, maps, scale, seg, start, len, lane);
        }
        now = next;
    }
}

template <typename Rule, MasterKind K, typename Tune>
__global__ void __launch_bounds__(kWarps * 32, Tune::kMinBlocks) fused_step_kernel(StepArgs a) {
    constexpr int S = Rule::kStates;
    __shared__ MapSmem maps[S];
#pragma unroll
    for (int k = 0; k < S; ++k) fill_map<Tune::kSelects>(maps[k], a.qmap[k], a.tables[k]);
    __syncthreads();
    Scale scale = a.scale;  // a device factor is read here, by the kernel: the host never waits for it
    if (scale.on_device) scale.value = *scale.pointer;

    const int lane = threadIdx.x & 31;
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    int64_t work = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    if constexpr (Tune::kStaged) {
        extern __shared__ __align__(16) uint8_t staged_slots[];  // dynamic_shared_bytes<Tune>()
        staged_loop<Rule, K, Tune>(a, maps, scale, work, warps, lane,
                                   staged_slots + (threadIdx.x >> 5) * 2 * 32 * kSlotBytes);
        return;
    }
    if constexpr (Tune::kBlocksPerStep > 1) {  // items work + b * warps (b < B) together, then B * warps further on
        for (; work < a.total_blocks; work += Tune::kBlocksPerStep * warps) {
            step_work<Rule, K, Tune>(a, maps, scale, work, warps, lane);
        }
        return;
    }
    int32_t upcoming = Tune::kPrefetchSegment && work < a.total_blocks ? a.block_segment[work] : 0;
    for (; work < a.total_blocks; work += warps) {
        int32_t index;
        if (Tune::kPrefetchSegment) {
            index = upcoming;
            if (work + warps < a.total_blocks) upcoming = a.block_segment[work + warps];
        } else {
            index = a.block_segment[work];
        }
        Segment seg;
        int64_t start;
        int len;
        locate(a, work, index, seg, start, len);
        step_one<Rule, K, Tune>(a, maps, scale, seg, start, len, lane);
    }
}

// Thread blocks for the launch: every SM full (the occupancy the compiled kernel allows), no more than the work.
template <typename Kernel>
inline int grid_for(Kernel kernel, int64_t total_blocks, int dynamic_bytes = 0) {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, dynamic_bytes);
    const int64_t needed = (total_blocks + kWarps - 1) / kWarps;
    const int64_t resident = static_cast<int64_t>(sms) * (per_sm > 0 ? per_sm : 1);
    return static_cast<int>(needed < resident ? needed : resident);
}

// Lets `kernel` (built with shape Tune) launch with the dynamic shared memory the shape asks for: above 48 KiB of
// shared memory in all, a kernel must ask for it. The CUDA error code (cudaSuccess where the shape needs none).
template <typename Tune, typename Kernel>
inline cudaError_t allow_dynamic_shared(Kernel kernel) {
    constexpr int dynamic = dynamic_shared_bytes<Tune>();
    return dynamic > 0 ? cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dynamic)
                       : cudaSuccess;
}

// Whether every map of Rule's states has the compact table its quantizer reads (bnb's arithmetic: sorted too).
template <typename Rule>
inline bool fast_maps(const StepArgs& a) {
    for (int j = 0; j < Rule::kStates; ++j) {
        if (!a.tables[j].fast || (Rule::kBnb && !a.tables[j].sorted)) return false;
    }
    return true;
}

// Launches Rule's kernel for master kind K on `stream`; returns the CUDA error code (0: none).
template <typename Rule, MasterKind K, typename Tune = typename Rule::Shape>
int launch_kind(const StepArgs& a, void* stream) {
    if (a.total_blocks == 0) return 0;
    if constexpr (Tune::kFastMaps) {
        if (!fast_maps<Rule>(a)) return launch_kind<Rule, K, typename Tune::Generic>(a, stream);
    }
    auto kernel = fused_step_kernel<Rule, K, Tune>;
    constexpr int dynamic = dynamic_shared_bytes<Tune>();
    const cudaError_t status = allow_dynamic_shared<Tune>(kernel);
    if (status != cudaSuccess) return static_cast<int>(status);
    kernel<<<grid_for(kernel, a.total_blocks, dynamic), kWarps * 32, dynamic, static_cast<cudaStream_t>(stream)>>>(a);
    return static_cast<int>(cudaGetLastError());
}

// Launches Rule's kernel for the master kind of `a` on `stream`; returns the CUDA error code (0: none).
template <typename Rule, typename Tune = typename Rule::Shape>
int launch(const StepArgs& a, void* stream) {
    switch (a.params.kind) {
        case MasterKind::kBFloat16: return launch_kind<Rule, MasterKind::kBFloat16, Tune>(a, stream);
        case MasterKind::kCompensated: return launch_kind<Rule, MasterKind::kCompensated, Tune>(a, stream);
        case MasterKind::kFloat32WithBf16Copy:
            return launch_kind<Rule, MasterKind::kFloat32WithBf16Copy, Tune>(a, stream);
        default: return launch_kind<Rule, MasterKind::kFloat32, Tune>(a, stream);
    }
}

// --- pieces the rules share -------------------------------------------------------------------------------------
struct IeeeQuantizer {  // Ieee: the reference's dequantization and NaN-propagating absmax
    static constexpr bool kBnb = false;
    __device__ static __forceinline__ float dequantize(float q, float absmax) { return __fmul_rn(q, absmax); }
    __device__ static __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }
    __device__ static __forceinline__ float absmax_merge(float best, float s) { return nan_max(best, fabsf(s)); }
    __device__ static __forceinline__ float absmax_reduce(float a, float b) { return nan_max(a, b); }
};

struct BnbQuantizer {  // bnb: flush-to-zero dequantization, NaN-dropping absmax from -FLT_MAX
    static constexpr bool kBnb = true;
    static constexpr bool kFloor = false;
    __device__ static __forceinline__ float dequantize(float q, float absmax) { return bnbmath::mul(absmax, q); }
    __device__ static __forceinline__ float absmax_merge(float best, float s) {
        return bnbmath::max(best, bnbmath::absmax_term(s));
    }
    __device__ static __forceinline__ float absmax_reduce(float a, float b) { return bnbmath::max(a, b); }
    using Consts = bnbmath::Consts;
    __device__ static __forceinline__ Consts prepare(const float* row) { return bnbmath::prepare(row); }
};

}  // namespace device
}  // namespace dsbnb
