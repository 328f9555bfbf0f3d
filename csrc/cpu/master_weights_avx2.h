// master_weights_avx2.h — compensated master weights (a bf16 weight plus an int8 rounding error) widened and split
// 8 at a time in AVX2 intrinsics: join8 and split8 give, lane by lane, the bits of dsbnb::join and dsbnb::split
// (csrc/include/dsbnb/master_weights.h), which the CPU kernels' compensated blocks (fused_cpu.h: with_fp32_master) run
// where the compiler targets AVX2 but not AVX-512 F, BW and DQ (AMD Zen 2 and Zen 3 hosts; AVX-512 builds take
// master_weights_avx512.h's 16-lane spelling).
//
// Why: on such a build gcc's vectorization of the scalar join and split loops cost the 8-bit AdamW step about 0.85 ns
// per element (measured on an AMD Zen 5 core running the x86-64-v3 build, 1M elements, one thread: the compensated
// step 1.28-1.36x the fp32-master one), seven times the 16-lane spelling's cost on the same core.
// The lanes compute what the scalar code computes, operation for operation: the error exponent from the exponent
// field, each power of two 2^k as a float built from its exponent field (k within a normal float's range), the
// product lo * 2^e and the quotient x * 2^-e each as two exact scalings (dsbnb::div_error_unit's spelling; every
// intermediate is a float), the same IEEE add, round to nearest even and clamp, the choices as blends. Held to the
// literal frexp/ldexp definition over the values the 16-lane spelling is held to (every bf16 value and error byte;
// every float within 64 ulps of every bf16 value and 2^24 random ones) by tests/native/master_weights_check.cpp,
// wherever the compiler targets AVX2 (so on AVX-512 hosts too), and to the pure-torch reference by the kernels' tests
// on an x86-64-v3 build.
// References: Intel intrinsics guide (VPMOVZXWD, VPMOVSXBD, VROUNDPS, VBLENDVPS, PACKUSDW, PACKSSDW, PACKSSWB);
// deepspeed_bnb/ops/compensated.py.
// Build and test: header only, compiled into the CPU kernels where the compiler targets AVX2 without AVX-512 F, BW
// and DQ; pytest tests/kernels/test_master_weights_native.py; python benchmarks/bench_optimizer_step.py --march
// x86-64-v3 --rows "deepspeed_bnb C++ kernel (8-bit)" "deepspeed_bnb C++ kernel (8-bit), bf16+8 master weights".
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

#include "dsbnb/master_weights.h"

namespace dsbnb {
namespace avx2 {

// 2^k for 8 exponents k in [-126, 127]: a normal float, its exponent field k + 127.
__attribute__((always_inline)) inline __m256 power_of_two8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

// dsbnb::error_exponent of 8 weights: max(b, 1) - 142, b the biased exponent (255 for infinities and NaNs: 113).
__attribute__((always_inline)) inline __m256i error_exponent8(__m256 x) {
    const __m256i biased = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 23), _mm256_set1_epi32(0xFF));
    return _mm256_sub_epi32(_mm256_max_epi32(biased, _mm256_set1_epi32(1)), _mm256_set1_epi32(142));
}

// x * 2^k for k in [-141, 141] as two exact scalings by normal powers of two, 2^(k >> 1) then 2^(k - (k >> 1)) (each
// in [-71, 71]): exact wherever x * 2^k is a float and the first product is one, as it is for every join and split
// (see dsbnb::div_error_unit).
__attribute__((always_inline)) inline __m256 scale8(__m256 x, __m256i k) {
    const __m256i first = _mm256_srai_epi32(k, 1);
    return _mm256_mul_ps(_mm256_mul_ps(x, power_of_two8(first)), power_of_two8(_mm256_sub_epi32(k, first)));
}

// dsbnb::join of 8 bf16 weights hi[0..7] and their error steps lo[0..7].
__attribute__((always_inline)) inline __m256 join8(const uint16_t* hi, const int8_t* lo) {
    const __m256 wide = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi))), 16));
    const __m256i steps = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo)));
    // lo * error_unit(wide): |lo| <= 128 times 2^e, e in [-141, 113], a float, and so is lo * 2^(e >> 1)
    const __m256 joined = _mm256_add_ps(wide, scale8(_mm256_cvtepi32_ps(steps), error_exponent8(wide)));
    // lo == 0 keeps the weight itself (-0.0 and NaN payloads included, which the add would change)
    return _mm256_blendv_ps(joined, wide, _mm256_castsi256_ps(_mm256_cmpeq_epi32(steps, _mm256_setzero_si256())));
}

// dsbnb::split of 8 fp32 weights w into bf16 bits hi[0..7] and error steps lo[0..7].
__attribute__((always_inline)) inline void split8(__m256 w, uint16_t* hi, int8_t* lo) {
    // dsbnb::bf16_round: round to nearest even on the bits, NaN -> the quiet NaN
    const __m256i bits = _mm256_castps_si256(w);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
    top = _mm256_blendv_epi8(top, _mm256_set1_epi32(kBf16QuietNaN),
                             _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q)));
    const __m256 rounded = _mm256_castsi256_ps(_mm256_slli_epi32(top, 16));
    // div_error_unit(w - rounded, rounded): x * 2^k, k = -error_exponent(rounded) in [-113, 141]
    const __m256 quotient = scale8(_mm256_sub_ps(w, rounded),
                                   _mm256_sub_epi32(_mm256_setzero_si256(), error_exponent8(rounded)));
    __m256 steps = _mm256_round_ps(quotient, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // a non-finite step count is 0; then clamped to +-kMaxErrorSteps (finite: min and max choose as the scalar code)
    const __m256 magnitude = _mm256_and_ps(steps, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
    steps = _mm256_and_ps(steps, _mm256_cmp_ps(magnitude, _mm256_set1_ps(3.40282347e+38f), _CMP_LE_OQ));
    steps = _mm256_max_ps(_mm256_min_ps(steps, _mm256_set1_ps(kMaxErrorSteps)), _mm256_set1_ps(-kMaxErrorSteps));
    const __m256i count = _mm256_cvttps_epi32(steps);  // whole numbers: truncation is exact
    // top is in [0, 0xFFFF] and count in [-127, 127]: the packs narrow without saturating
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
    const __m128i count16 = _mm_packs_epi32(_mm256_castsi256_si128(count), _mm256_extracti128_si256(count, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(lo), _mm_packs_epi16(count16, count16));
}

}  // namespace avx2
}  // namespace dsbnb
#endif
