// master_weights_avx512.h — compensated master weights (a bf16 weight plus an int8 rounding error) widened and split
// 16 at a time in AVX-512 intrinsics: join16 and split16 give, lane by lane, the bits of dsbnb::join and dsbnb::split
// (csrc/include/dsbnb/master_weights.h), which the CPU kernels' full-block path (fused_cpu.h: with_fp32_master) runs
// around every update of a block of compensated weights.
//
// Why: gcc vectorizes the scalar join and split loops, but keeps every per-element choice (lo == 0, NaN, the subnormal
// unit, the clamp) as 64-lane byte masks that it spills to the stack and splits into 16-lane ones (kmov, kshift,
// kunpck: most of the samples of the compensated loops in perf). Measured on an AMD Zen 5 core (AdamW 8-bit, 1M
// elements, one thread): the compensated step 1.50-1.54x the fp32-master step with the compiler's loops, 1.21-1.29x
// with these (the error unit applied by VSCALEFPS, one exact instruction; 1.34-1.35x with the scalar code's integer
// spelling of the unit and its two products), and 1.13-1.21x (against 1.22-1.31x in the same alternating runs) with
// the exponent read by VGETEXPPS, the non-finite error zeroed by VFIXUPIMMPS and the high clamp left to the narrowing's
// saturation (split16: 18 operations per 16 weights instead of 25).
// The bf16 rounding of bf16 master weights, of split16 and of the model's bf16 copy (bf16_bits16, store_bf16) is one
// VCVTNEPS2BF16 where the compiler targets AVX512_BF16, with bf16_round16's answer for the NaN and subnormal lanes the
// instruction rounds otherwise. Measured on the same core (1 thread, the 8-bit AdamW kernel writing the model's bf16
// copy, previous build and this one alternating): 0.81-0.85x -> 0.90-0.94x the rate without the copy at 1M elements,
// 0.76-0.83x -> 0.93-1.02x at 16M, where the compiler's loop had made the fused copy slower than the kernel followed
// by torch's own conversion pass; the bf16 and compensated master-weight steps measured unchanged (within noise).
// The lanes compute what the scalar code computes (the same IEEE add, power-of-two scalings and round to nearest
// even; its choices as selects, or as instructions that make the same choice: a class table, a saturation), so the
// bits are the same: held to the scalar functions and to their literal frexp/ldexp definition for every bf16 value
// and error byte (join), every float within 64 ulps of every bf16 value and 2^24 random ones (split), every float
// (bf16_bits16) by tests/native/master_weights_check.cpp, and to the pure-torch reference by the kernels' tests
// (tests/kernels/test_fused_rules.py -k "master_weights or subnormal_and_nan").
// References: Intel intrinsics guide (VSCALEFPS, VGETEXPPS, VFIXUPIMMPS, VPMOVDW, VPMOVSDB, VCVTNEPS2BF16: its
// rounding, denormal and NaN rules in the Intel SDM); deepspeed_bnb/ops/compensated.py.
// Build and test: header only, compiled into the CPU kernels where the compiler targets AVX-512 F, BW and DQ (see
// adam8bit_avx512.h); pytest tests/kernels/test_master_weights_native.py tests/kernels/test_fused_rules.py.
#pragma once

#include "adam8bit_avx512.h"  // DSBNB_AVX512, <immintrin.h>
#include "dsbnb/master_weights.h"

#if DSBNB_AVX512
namespace dsbnb {
namespace avx512 {

// VFIXUPIMMPS's table (a response per class of the value: QNaN, SNaN, zero, one, -inf, +inf, negative, positive, four
// bits each from the lowest): 8 (+0) for the NaNs and infinities, 0 (the value itself) for the rest.
constexpr int kZeroNonFinite = 0x00880088;

// The error exponent (dsbnb::error_exponent: max(b, 1) - 142, b the biased exponent) of 16 weights, as floats for
// VSCALEFPS: x * 2^e in one instruction, exact wherever the product is a float (error_unit is 2^e). VGETEXPPS gives
// b - 127 for normal weights, less than -126 for subnormal ones and -inf for zeros (max(b, 1) - 127 = -126 for both),
// +inf for infinities and NaN for NaNs (b = 255: 128; max(-126, NaN) keeps the NaN and min(NaN, 128) gives 128, as
// MAXPS and MINPS return their second operand where one is NaN): four operations instead of the field's five.
__attribute__((always_inline)) inline __m512 error_exponent16(__m512 wide) {
    const __m512 exponent = _mm512_min_ps(_mm512_max_ps(_mm512_set1_ps(-126.0f), _mm512_getexp_ps(wide)),
                                          _mm512_set1_ps(128.0f));
    return _mm512_sub_ps(exponent, _mm512_set1_ps(15.0f));
}

// dsbnb::join of 16 bf16 weights hi[0..15] and their error steps lo[0..15].
__attribute__((always_inline)) inline __m512 join16(const uint16_t* hi, const int8_t* lo) {
    const __m512 wide = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi))), 16));
    const __m512i steps = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
    // lo * error_unit(wide): a power of two times |lo| <= 127, a float (a subnormal one at the least), so exact
    const __m512 error = _mm512_scalef_ps(_mm512_cvtepi32_ps(steps), error_exponent16(wide));
    // lo == 0 keeps the weight itself (-0.0 and NaN payloads included, which the add would change): a masked add
    return _mm512_mask_add_ps(wide, _mm512_test_epi32_mask(steps, steps), wide, error);
}

// dsbnb::bf16_round of 16 floats, each in the low 16 bits of its 32-bit lane: round to nearest even on the bits, NaN
// -> the quiet NaN.
__attribute__((always_inline)) inline __m512i bf16_round16(__m512 w) {
    const __m512i bits = _mm512_castps_si512(w);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
    return _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(w, w, _CMP_UNORD_Q), _mm512_set1_epi32(kBf16QuietNaN));
}

// dsbnb::bf16_round of 16 floats, as 16 bf16 bit patterns in order. Where the compiler targets AVX512_BF16 (AMD Zen 4
// and later, Intel Cooper Lake, Sapphire Rapids and later): VCVTNEPS2BF16, one instruction for bf16_round16's seven,
// which rounds to nearest even as bf16_round does but flushes a subnormal input to zero and keeps a NaN's sign and
// payload; the lanes holding either (kNanOrSubnormal, one class test; never in the weights of a training run that
// goes well) take bf16_round16's answer instead.
constexpr int kNanOrSubnormal = 0x01 | 0x80 | 0x20;  // VFPCLASSPS's classes: quiet NaN, signalling NaN, denormal

__attribute__((always_inline)) inline __m256i bf16_bits16(__m512 w) {
#if defined(__AVX512BF16__)
    const __m256i converted = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w));
    const __mmask16 odd = _mm512_fpclass_ps_mask(w, kNanOrSubnormal);
    if (__builtin_expect(odd == 0, 1)) return converted;
    return _mm256_mask_mov_epi16(converted, odd, _mm512_cvtepi32_epi16(bf16_round16(w)));
#else
    return _mm512_cvtepi32_epi16(bf16_round16(w));
#endif
}

// bf16_round of len floats p into out, 16 at a time (bf16_bits16), the rest one at a time: bf16 master weights and
// the model's bf16 copy (fused_cpu.h: store_bf16).
__attribute__((always_inline)) inline void store_bf16(uint16_t* out, const float* p, int64_t len) {
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), bf16_bits16(_mm512_loadu_ps(p + j)));
    }
    for (; j < len; ++j) out[j] = bf16_round(p[j]);
}

// dsbnb::split of 16 fp32 weights w into bf16 bits hi[0..15] and error steps lo[0..15].
__attribute__((always_inline)) inline void split16(__m512 w, uint16_t* hi, int8_t* lo) {
    const __m256i top = bf16_bits16(w);
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(top), 16));
    // div_error_unit(w - rounded, rounded), x * 2^-e with -e = 15 - max(-126, getexp(rounded)) (error_exponent16
    // negated, without its clamp at 128: see below): exactly a float (div_error_unit's argument), so VSCALEFPS returns
    // it exactly, as the scalar code's two power-of-two products do
    const __m512 quotient = _mm512_scalef_ps(_mm512_sub_ps(w, rounded),
                                             _mm512_sub_ps(_mm512_set1_ps(15.0f), _mm512_max_ps(
                                                 _mm512_set1_ps(-126.0f), _mm512_getexp_ps(rounded))));
    // a non-finite quotient (w rounded to an infinity, a NaN) counts 0 steps, as a non-finite step count does in the
    // scalar code (rounding keeps a value finite or not): VFIXUPIMMPS's table answers +0 for the NaN and infinity
    // classes and keeps the rest (so the exponent's min at 128 is not needed here: an infinite or NaN `rounded` makes
    // the quotient non-finite whatever its scale)
    const __m512 finite = _mm512_fixupimm_ps(quotient, quotient, _mm512_set1_epi32(kZeroNonFinite), 0);
    // rounded half to even (the scalar rintf), then clamped to +-kMaxErrorSteps: the finite quotient lies within
    // +-128 (half a bf16 ulp in error steps), so the max is the low clamp and the narrowing's signed saturation
    // (VPMOVSDB) the high one
    const __m512i nearest = _mm512_cvt_roundps_epi32(finite, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i steps = _mm512_max_epi32(nearest, _mm512_set1_epi32(-static_cast<int>(kMaxErrorSteps)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), top);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtsepi32_epi8(steps));
}

}  // namespace avx512
}  // namespace dsbnb
#endif
