// dsbnb/bnb_cuda_math.h — bitsandbytes' own CUDA arithmetic, operation by operation, for the fused kernels' "bnb_cuda"
// arithmetic: what bnb's optimizer kernels compute per element, so that the fused step on a GPU gives the user's bnb
// optimizer's bits (weights and state) while running as one launch per partition.
//
// What bnb computes is fixed by its shipped binary, not by its source alone: it is built with --use_fast_math, so
// every operation flushes subnormals to zero, divisions are a hardware reciprocal times the dividend, sqrt and powf are
// the approximate hardware instructions, and the compiler fused some products into FMAs (and not others, differently
// per kernel and gradient type). Each function below spells out one of bnb's kernels with explicit PTX instructions
// (mul/add/fma .rn.ftz, rcp/sqrt/lg2/ex2 .approx.ftz, cvt.rn.bf16), read off the sm_90 SASS of
// libbitsandbytes_cuda130.so (bitsandbytes 0.50.2) and cross-checked with csrc/kernels.cu:
//   adam_8bit   kOptimizerStatic8bit2StateBlockwise<T, ADAM, 256, 1>     (T = float or bf16)
//   lion_8bit   kOptimizerStatic8bit1StateBlockwise<T, LION, 256, 1>
//   momentum_8bit kOptimizerStatic8bit1StateBlockwise<T, MOMENTUM, 256, 1>
//   adam_32bit, lion_32bit, momentum_32bit: kOptimizer32bit2State / kOptimizer32bit1State (parameters with 32-bit
//   state), including their quirks: no finiteness test; f32 SGD-momentum with weight decay fuses the decay term
//   differently for the first of every four elements (its loop is unrolled four ways).
// bnb's update_step always passes gnorm_scale 1, skip_zeros false and (for the kernels' fields the contract admits)
// max_unorm 0, so those branches are not modelled (ops/rule_fields.py refuses other values before a kernel runs).
// The 8-bit quantizer (quantize_2D, ties to the even sorted index, a NaN to code 0, the sign fix of signed states)
// is csrc/include/dsbnb/compact_quantizer.h and the kernel skeleton csrc/cuda/fused_step.cuh.
// Semantics are device-only: rcp/sqrt/lg2/ex2.approx have no documented bit-exact host equivalent, so these
// functions are held to bitsandbytes itself on a GPU (tests/gpu: the proof's kernel part, over many steps), not to
// the pure-torch reference (which defines the "ieee" arithmetic).
// Build: included by the CUDA kernels only (nvcc); the explicit PTX makes the results independent of -fmad and -ftz.
#pragma once

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cstdint>

namespace dsbnb {
namespace bnbmath {

// --- bnb's primitives (all flush subnormal inputs and results to zero) -------------------------------------------
__device__ __forceinline__ float mul(float a, float b) {
    float r;
    asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float add(float a, float b) {
    float r;
    asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float fma(float a, float b, float c) {  // a * b + c, one rounding
    float r;
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
__device__ __forceinline__ float rcp(float a) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float sqrt(float a) {
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float lg2(float a) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float ex2(float a) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}
// Ordered comparisons with subnormals as zero (FSETP.*.FTZ): false for NaN.
__device__ __forceinline__ bool gt(float a, float b) {
    uint32_t r;
    asm("{ .reg .pred p; setp.gt.ftz.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return r != 0;
}
__device__ __forceinline__ bool lt(float a, float b) { return gt(b, a); }
// max(a, b) that returns the other operand when one is NaN (FMNMX.FTZ).
__device__ __forceinline__ float max(float a, float b) {
    float r;
    asm("max.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
// Round to bf16, nearest even, and back to fp32 (F2FP.BF16.F32: bnb's T = bf16 stores).
__device__ __forceinline__ float bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// bnb's sgn (kernels.cu): (0 < x) - (x < 0) with ordered FTZ compares, as an fp32: +1, -1, +0 (zero, subnormal, NaN).
__device__ __forceinline__ float sgn(float x) {
    return __int2float_rn(static_cast<int>(gt(x, 0.0f)) - static_cast<int>(lt(x, 0.0f)));
}
// -x: a sign flip, exact (bnb's SASS folds negations into operands).
__device__ __forceinline__ float neg(float x) { return __uint_as_float(__float_as_uint(x) ^ 0x80000000u); }
// __powf(base, step): ex2(step * lg2(base)).
__device__ __forceinline__ float pow(float base, float step) { return ex2(mul(step, lg2(base))); }

// cond ? a : b as one PTX selp. Being an asm operand, each of a and b is computed for every element: the compiler can
// neither sink their computation into a branch of its own nor turn the select into one, which it does with a C++
// conditional whose arm is expensive (fused_step.cuh: Tuning::kSelects).
__device__ __forceinline__ float pick(bool cond, float a, float b) {
    float r;
    asm("{ .reg .pred q; setp.ne.u32 q, %3, 0; selp.f32 %0, %1, %2, q; }"
        : "=f"(r) : "f"(a), "f"(b), "r"(static_cast<uint32_t>(cond)));
    return r;
}
__device__ __forceinline__ uint32_t pick(bool cond, uint32_t a, uint32_t b) {
    uint32_t r;
    asm("{ .reg .pred q; setp.ne.u32 q, %3, 0; selp.b32 %0, %1, %2, q; }"
        : "=r"(r) : "r"(a), "r"(b), "r"(static_cast<uint32_t>(cond)));
    return r;
}
// An element's updated value, or with Selects the old one where its gradient is not finite (by pick). Without Selects
// the caller has returned for a non-finite gradient already, so the update stands.
template <bool Selects>
__device__ __forceinline__ float kept(bool finite, float updated, float old) {
    return Selects ? pick(finite, updated, old) : updated;
}

// --- per-row constants, as bnb's kernels compute them per thread from its float arguments ----------------------
// The hyper row (BnbRow in dsbnb/adam8bit.h) holds bnb's kernel arguments rounded to float as ctypes.c_float does,
// and the step as the float I2FP makes of it.
struct Consts {
    float beta1, beta2, eps, weight_decay, lr, step, gnorm_scale;  // the row
    float one_minus_beta1, one_minus_beta2;  // add(1, -beta)
    float correction2;                       // sqrt(1 - beta2^t)                      (Adam)
    float step_size;                         // (correction2 * lr) * -rcp(1 - beta1^t)  (Adam)
    float decay;                             // fma(-lr, wd, 1)                          (Adam, Lion)
    bool decays;                             // 0 < weight_decay (FTZ compare)
    bool first;                              // step == 1 (SGD-momentum)
};

__device__ __forceinline__ Consts prepare(const float* row) {
    Consts c;
    c.beta1 = row[0];
    c.beta2 = row[1];
    c.eps = row[2];
    c.weight_decay = row[3];
    c.lr = row[4];
    c.step = row[5];
    c.gnorm_scale = row[6];
    c.one_minus_beta1 = add(neg(c.beta1), 1.0f);
    c.one_minus_beta2 = add(neg(c.beta2), 1.0f);
    c.correction2 = sqrt(add(neg(pow(c.beta2, c.step)), 1.0f));
    const float correction1 = add(neg(pow(c.beta1, c.step)), 1.0f);
    c.step_size = mul(mul(c.correction2, c.lr), neg(rcp(correction1)));
    c.decay = fma(neg(c.lr), c.weight_decay, 1.0f);
    c.decays = lt(0.0f, c.weight_decay);
    c.first = c.step == 1.0f;
    return c;
}

// --- 8-bit blockwise kernels: one element, its dequantized old state(s) in s1 (and s2); p and the states updated.
// `bf16`: bnb's T = bf16 kernel (bf16 master weights: p holds a bf16 value and is rounded where bnb rounds it).
// g is the gradient as bnb's kernel loads it (fp32, or a bf16 widened exactly).

// kOptimizerStatic8bit2StateBlockwise<T, ADAM> for a finite gradient. Selects: the weight decay's choice by pick().
template <bool Bf16, bool Selects = false>
__device__ __forceinline__ void adam_8bit_finite(const Consts& c, float& p, float g, float& s1, float& s2) {
    const float gv = mul(g, c.gnorm_scale);
    s1 = fma(gv, c.one_minus_beta1, mul(s1, c.beta1));
    if (Bf16) {
        s2 = fma(s2, c.beta2, mul(gv, mul(gv, c.one_minus_beta2)));
    } else {
        s2 = fma(gv, mul(c.one_minus_beta2, gv), mul(s2, c.beta2));
    }
    const float update = fma(c.step_size, mul(rcp(fma(c.correction2, c.eps, sqrt(s2))), s1), p);
    if (Selects) {
        const float x = Bf16 ? bf16(update) : update;
        const float decayed = Bf16 ? bf16(mul(c.decay, x)) : mul(c.decay, x);
        p = pick(c.decays, decayed, x);
    } else if (Bf16) {
        p = bf16(update);
        if (c.decays) p = bf16(mul(c.decay, p));
    } else {
        p = c.decays ? mul(c.decay, update) : update;
    }
}

// kOptimizerStatic8bit2StateBlockwise<T, ADAM>: a non-finite gradient zeroes both states and keeps p.
// Selects: the update is computed for every gradient and the finite test selects its results (the same values as
// the early return), so the element is no branch of its own (fused_step.cuh: Tuning::kSelects).
template <bool Bf16, bool Selects = false>
__device__ __forceinline__ void adam_8bit(const Consts& c, float& p, float g, float& s1, float& s2) {
    const bool finite = fabsf(g) < __int_as_float(0x7F800000);  // FSETP.GEU |g|, +INF: false for NaN and +-inf
    if (Selects) {
        float x = p, m = s1, v = s2;
        adam_8bit_finite<Bf16, true>(c, x, g, m, v);
        p = pick(finite, x, p);
        s1 = pick(finite, m, 0.0f);
        s2 = pick(finite, v, 0.0f);
        return;
    }
    if (!finite) {
        s1 = 0.0f;
        s2 = 0.0f;
        return;
    }
    adam_8bit_finite<Bf16>(c, p, g, s1, s2);
}

// kOptimizerStatic8bit1StateBlockwise<T, LION>: no finiteness test (sgn(NaN) is 0: p only decays, the state takes
// the NaN); the step lr * sgn is rounded to bf16 in the bf16 kernel (bnb keeps it in its bf16 gradient array).
template <bool Bf16>
__device__ __forceinline__ void lion_8bit(const Consts& c, float& p, float g, float& s1) {
    const float gv = mul(g, c.gnorm_scale);
    const float direction = fma(gv, c.one_minus_beta1, mul(s1, c.beta1));
    s1 = fma(gv, c.one_minus_beta2, mul(s1, c.beta2));
    float step = mul(sgn(direction), c.lr);
    if (Bf16) {
        if (c.decays) p = bf16(mul(c.decay, p));
        step = bf16(step);
        p = bf16(add(p, neg(step)));
    } else {
        if (c.decays) p = mul(c.decay, p);
        p = add(p, neg(step));
    }
}

// kOptimizerStatic8bit1StateBlockwise<T, MOMENTUM>: coupled weight decay, m = g at step 1, no finiteness test.
template <bool Bf16>
__device__ __forceinline__ void momentum_8bit(const Consts& c, float& p, float g, float& s1) {
    float gv = mul(g, c.gnorm_scale);
    if (c.decays) gv = fma(p, c.weight_decay, gv);
    s1 = c.first ? gv : fma(s1, c.beta1, gv);
    p = fma(neg(s1), c.lr, p);
    if (Bf16) p = bf16(p);
}

// --- 32-bit kernels (parameters with fp32 state): `slot` is the element's index in bnb's call mod 4 ---------------

// kOptimizer32bit2State<T, ADAM>: no finiteness test; the gradient rounded to T after the gnorm_scale multiply.
template <bool Bf16>
__device__ __forceinline__ void adam_32bit(const Consts& c, float& p, float g, float& s1, float& s2) {
    float gv = mul(g, c.gnorm_scale);
    if (Bf16) gv = bf16(gv);
    s2 = fma(s2, c.beta2, mul(c.one_minus_beta2, mul(gv, gv)));
    s1 = fma(s1, c.beta1, mul(gv, c.one_minus_beta1));
    float x = fma(c.step_size, mul(s1, rcp(fma(c.correction2, c.eps, sqrt(s2)))), p);
    if (Bf16) x = bf16(x);
    if (c.decays) {
        x = mul(c.decay, x);
        if (Bf16) x = bf16(x);
    }
    p = x;
}

// kOptimizer32bit1State<T, LION> with skip_zeros false: the f32 kernel fuses the decay into the step when it decays.
template <bool Bf16>
__device__ __forceinline__ void lion_32bit(const Consts& c, float& p, float g, float& s1) {
    float gv = mul(g, c.gnorm_scale);
    if (Bf16) gv = bf16(gv);
    const float direction = fma(s1, c.beta1, mul(gv, c.one_minus_beta1));
    s1 = fma(s1, c.beta2, mul(gv, c.one_minus_beta2));
    const float step = mul(sgn(direction), c.lr);
    if (Bf16) {
        if (c.decays) p = bf16(mul(c.decay, p));
        p = bf16(fma(step, -1.0f, p));
    } else {
        p = c.decays ? fma(c.decay, p, neg(step)) : fma(step, -1.0f, p);
    }
}

// kOptimizer32bit1State<T, MOMENTUM>: coupled decay, fused with the gradient differently for slot 0 in the f32
// kernel; the bf16 kernel rounds the gradient to bf16 after each of its two terms (bnb 0.50 has no Python entry to
// its bf16 momentum kernel, so bf16 master weights with 32-bit SGD state never reach here from bnb itself).
template <bool Bf16>
__device__ __forceinline__ void momentum_32bit(const Consts& c, float& p, float g, float& s1, int slot) {
    float gv;
    if (Bf16) {
        gv = bf16(mul(g, c.gnorm_scale));
        if (c.decays) gv = bf16(fma(p, c.weight_decay, gv));
    } else if (c.decays) {
        gv = slot == 0 ? fma(p, c.weight_decay, mul(g, c.gnorm_scale))
                       : fma(g, c.gnorm_scale, mul(p, c.weight_decay));
    } else {
        gv = mul(g, c.gnorm_scale);
    }
    s1 = c.first ? gv : fma(s1, c.beta1, gv);
    p = fma(mul(s1, c.lr), -1.0f, p);
    if (Bf16) p = bf16(p);
}

// --- block absmax and quantization of the 8-bit kernels ------------------------------------------------------------
constexpr float kMinusFltMax = -3.40282347e+38f;

// One element's term of the block maximum: max(|s|, -FLT_MAX), which drops a NaN (bnb's FMNMX).
__device__ __forceinline__ float absmax_term(float s) { return max(fabsf(s), kMinusFltMax); }

// `code` moved one towards s where `differs`, as selects: both codes formed, one picked.
__device__ __forceinline__ uint8_t moved_where(bool differs, uint8_t code, float s) {
    const uint32_t moved = static_cast<uint8_t>(pick(gt(s, 0.0f), code + 1u, code - 1u));
    return static_cast<uint8_t>(pick(differs, moved, code));
}

// bnb's sign fix after quantize_2D for signed states: a code whose map value's sign bit differs from s's moves one
// code towards s (unsigned char arithmetic: 0 - 1 wraps to 255). Selects: the moved code is formed always and
// selected, no branch (moved_where).
template <bool Selects = false>
__device__ __forceinline__ uint8_t sign_fix(uint8_t code, float s, const float* map) {
    const bool differs = (__float_as_uint(map[code]) >> 31) != (__float_as_uint(s) >> 31);
    if (Selects) return moved_where(differs, code, s);
    if (differs) {
        return static_cast<uint8_t>(gt(s, 0.0f) ? code + 1 : code - 1);
    }
    return code;
}

// sign_fix<true> for a map sorted ascending (code: the sorted index), whose first `negatives` entries have the sign bit
// set and the others not (strictly ascending, it holds at most one zero, of either sign): the map value's sign bit is
// code < negatives, no load.
__device__ __forceinline__ uint8_t sign_fix_sorted(uint8_t code, float s, int negatives) {
    return moved_where((static_cast<int>(code) < negatives) != ((__float_as_uint(s) >> 31) != 0), code, s);
}

}  // namespace bnbmath
}  // namespace dsbnb

#endif  // __CUDACC__
