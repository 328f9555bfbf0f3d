// master_weights_check.cpp — holds csrc/include/dsbnb/master_weights.h's compensated master weights (bf16 + int8
// error) to their literal definition (deepspeed_bnb/ops/compensated.py: one error step is 2^(E - 16), E the frexp
// exponent of the bf16 weight, at least -125), on the host: error_unit for every finite bf16 value against
// frexpf/ldexpf; join for every bf16 value and every error byte; split for every float within 64 ulps of every bf16
// value and 2^24 random bit patterns, against the same formulas spelled with frexpf/ldexpf.
// The CPU kernels' vector spellings are held to the same definitions over the same values: the 16-lane one where the
// compiler targets AVX-512 F, BW and DQ (csrc/cpu/master_weights_avx512.h: join16, split16), the 8-lane one where it
// targets AVX2 (csrc/cpu/master_weights_avx2.h: join8, split8; so on AVX-512 hosts too, though their kernels run the
// 16-lane one).
// The bf16 rounding of bf16 master weights and of the model's bf16 copy, 16 at a time (master_weights_avx512.h:
// bf16_bits16, VCVTNEPS2BF16 where the compiler targets AVX512_BF16), is held to the scalar bf16_round for every one
// of the 2^32 floats.
// Usage: master_weights_check. Prints "checked N mismatches M vector V bf16 S" (V: how many vector spellings of join
// and split were checked too: 2 on an AVX-512 build, 1 on an AVX2 one, else 0; S: the bf16 rounding spelling checked
// over every float: vcvtneps2bf16, integer, or none without AVX-512) and the first mismatches; exit code 1 on any.
// Build: g++ -O2 -march=native -std=c++17 -Icsrc/include -Icsrc/cpu tests/native/master_weights_check.cpp
// (tests/kernels/test_master_weights_native.py; -DMASTER_CHECK_MUTANT builds its control, a unit off by one exponent
// for subnormal weights; -DMASTER_CHECK_VECTOR_MUTANT the vector spellings' control, split's clamp to +-127 steps
// dropped; -DMASTER_CHECK_BF16_MUTANT the bf16 rounding's, its answer for NaN and subnormal floats dropped).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dsbnb/master_weights.h"
#include "master_weights_avx2.h"
#include "master_weights_avx512.h"

namespace {

using dsbnb::float_to_bits;

// The literal definitions, as compensated.py states them.
float literal_unit(float hi) {
    int exponent = dsbnb::kMinExponent;
    if (hi != 0.0f) {
        (void)std::frexp(hi, &exponent);
        exponent = exponent < dsbnb::kMinExponent ? dsbnb::kMinExponent : exponent;
    }
    return std::ldexp(1.0f, exponent - dsbnb::kErrorShift);
}

float literal_join(uint16_t hi, int8_t lo) {
    const float wide = dsbnb::bf16_value(hi);
    return lo == 0 ? wide : wide + static_cast<float>(lo) * literal_unit(wide);
}

void literal_split(float w, uint16_t& hi, int8_t& lo) {
    hi = dsbnb::bf16_round(w);
    const float rounded = dsbnb::bf16_value(hi);
    float steps = std::rint((w - rounded) / literal_unit(rounded));
    if (!(std::fabs(steps) <= 3.40282347e+38f)) steps = 0.0f;
    steps = steps < -dsbnb::kMaxErrorSteps ? -dsbnb::kMaxErrorSteps
                                           : (steps > dsbnb::kMaxErrorSteps ? dsbnb::kMaxErrorSteps : steps);
    lo = static_cast<int8_t>(steps);
}

float unit_under_test(float hi) {
#ifdef MASTER_CHECK_MUTANT
    const float unit = dsbnb::error_unit(hi);
    return hi != 0.0f && std::fabs(hi) < 1.17549435e-38f ? unit * 2.0f : unit;
#else
    return dsbnb::error_unit(hi);
#endif
}

struct Counter {
    unsigned long long checked = 0, mismatches = 0;
    void expect(bool same, const char* what, uint32_t a, uint32_t b) {
        ++checked;
        if (!same && ++mismatches <= 10) std::printf("mismatch in %s at 0x%08x (0x%08x)\n", what, a, b);
    }
};

}  // namespace

int main() {
    Counter c;
    for (uint32_t h = 0; h < (1u << 16); ++h) {
        const float hi = dsbnb::bf16_value(static_cast<uint16_t>(h));
        if (std::isfinite(hi)) {
            c.expect(float_to_bits(unit_under_test(hi)) == float_to_bits(literal_unit(hi)), "error_unit", h, 0);
        }
        for (int lo = -128; lo < 128; ++lo) {
            const float got = dsbnb::join(static_cast<uint16_t>(h), static_cast<int8_t>(lo));
            const float want = literal_join(static_cast<uint16_t>(h), static_cast<int8_t>(lo));
            const bool same = float_to_bits(got) == float_to_bits(want) || (got != got && want != want);
            c.expect(same, "join", h, static_cast<uint32_t>(lo));
        }
    }
    auto check_split = [&](uint32_t pattern) {
        const float w = dsbnb::bits_to_float(pattern);
        uint16_t hi, want_hi;
        int8_t lo, want_lo;
        dsbnb::split(w, hi, lo);
        literal_split(w, want_hi, want_lo);
        c.expect(hi == want_hi && lo == want_lo, "split", pattern, static_cast<uint32_t>(hi) << 8 | uint8_t(lo));
    };
    std::vector<uint32_t> patterns;  // split's inputs (the 16-lane spelling's too)
    for (uint32_t h = 0; h < (1u << 16); ++h) {  // around every bf16 value: where the rounding and the unit change
        for (int d = -64; d <= 64; ++d) patterns.push_back((h << 16) + static_cast<uint32_t>(d));
    }
    std::mt19937 rng(12345);
    for (int i = 0; i < (1 << 24); ++i) patterns.push_back(rng());  // ~256 ties (128 steps, clamped to 127) among them
    for (const uint32_t pattern : patterns) check_split(pattern);
    // the kernels' vector spellings, each over the same values: join for every bf16 value and error byte, split for
    // every pattern above (`lanes` at a time)
    int vector = 0;
    auto check_vector = [&](const char* name, int lanes, auto join_lanes, auto split_lanes) {
        ++vector;
        std::string join_name = std::string("join") + name, split_name = std::string("split") + name;
        for (uint32_t h = 0; h < (1u << 16); ++h) {
            for (int first = -128; first < 128; first += lanes) {
                uint16_t hi[16];
                int8_t lo[16];
                for (int k = 0; k < lanes; ++k) {
                    hi[k] = static_cast<uint16_t>(h);
                    lo[k] = static_cast<int8_t>(first + k);
                }
                alignas(64) float got[16];
                join_lanes(hi, lo, got);
                for (int k = 0; k < lanes; ++k) {
                    const float want = literal_join(hi[k], lo[k]);
                    const bool same =
                        float_to_bits(got[k]) == float_to_bits(want) || (got[k] != got[k] && want != want);
                    c.expect(same, join_name.c_str(), h, static_cast<uint32_t>(lo[k]));
                }
            }
        }
        for (size_t i = 0; i + lanes <= patterns.size(); i += lanes) {
            alignas(64) float w[16];
            for (int k = 0; k < lanes; ++k) w[k] = dsbnb::bits_to_float(patterns[i + k]);
            uint16_t hi[16];
            int8_t lo[16];
#ifdef MASTER_CHECK_VECTOR_MUTANT
            // the control: the steps' clamp dropped (a weight between two bf16 values' halfway points and 127 steps
            // away from the nearer one wraps around in the int8)
            for (int k = 0; k < lanes; ++k) {
                hi[k] = dsbnb::bf16_round(w[k]);
                const float steps = std::rint(dsbnb::div_error_unit(w[k] - dsbnb::bf16_value(hi[k]),
                                                                    dsbnb::bf16_value(hi[k])));
                lo[k] = std::fabs(steps) <= 3.40282347e+38f ? static_cast<int8_t>(static_cast<int>(steps)) : 0;
            }
            (void)split_lanes;
#else
            split_lanes(w, hi, lo);
#endif
            for (int k = 0; k < lanes; ++k) {
                uint16_t want_hi;
                int8_t want_lo;
                literal_split(w[k], want_hi, want_lo);
                c.expect(hi[k] == want_hi && lo[k] == want_lo, split_name.c_str(), patterns[i + k],
                         static_cast<uint32_t>(hi[k]) << 8 | uint8_t(lo[k]));
            }
        }
    };
#if DSBNB_AVX512
    check_vector(
        "16", 16,
        [](const uint16_t* hi, const int8_t* lo, float* out) { _mm512_store_ps(out, dsbnb::avx512::join16(hi, lo)); },
        [](const float* w, uint16_t* hi, int8_t* lo) { dsbnb::avx512::split16(_mm512_load_ps(w), hi, lo); });
#endif
#if defined(__AVX2__)
    check_vector(
        "8", 8,
        [](const uint16_t* hi, const int8_t* lo, float* out) { _mm256_store_ps(out, dsbnb::avx2::join8(hi, lo)); },
        [](const float* w, uint16_t* hi, int8_t* lo) { dsbnb::avx2::split8(_mm256_load_ps(w), hi, lo); });
#endif
    // the bf16 rounding of bf16 master weights and of the model's bf16 copy (bf16_bits16: by VCVTNEPS2BF16 where the
    // compiler targets AVX512_BF16), every float against the scalar bf16_round; its mismatches count with the rest,
    // its 2^32 values apart from `checked`
    const char* bf16 = "none";
#if DSBNB_AVX512
#if defined(__AVX512BF16__)
    bf16 = "vcvtneps2bf16";
#else
    bf16 = "integer";
#endif
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (uint64_t first = 0; first < (1ull << 32); first += 16) {
        const __m512 w = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)), lane));
#ifdef MASTER_CHECK_BF16_MUTANT
        // the control: the spelling without its answer for NaN and subnormal lanes
#if defined(__AVX512BF16__)
        const __m256i got = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(w));
#else
        const __m512i u = _mm512_castps_si512(w);
        const __m256i got = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(
            u, _mm512_set1_epi32(0x7FFF)), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16));
#endif
#else
        const __m256i got = dsbnb::avx512::bf16_bits16(w);
#endif
        alignas(32) uint16_t hi[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(hi), got);
        for (int k = 0; k < 16; ++k) {
            const uint32_t pattern = static_cast<uint32_t>(first) + static_cast<uint32_t>(k);
            if (hi[k] != dsbnb::bf16_round(dsbnb::bits_to_float(pattern)) && ++c.mismatches <= 10) {
                std::printf("mismatch in bf16_bits16 at 0x%08x (0x%04x)\n", pattern, hi[k]);
            }
        }
    }
#endif
    std::printf("checked %llu mismatches %llu vector %d bf16 %s\n", c.checked, c.mismatches, vector, bf16);
    return c.mismatches ? 1 : 0;
}
