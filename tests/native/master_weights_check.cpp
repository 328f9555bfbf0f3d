// master_weights_check.cpp — holds csrc/include/dsbnb/master_weights.h's compensated master weights (bf16 + int8
// error) to their literal definition (deepspeed_bnb/ops/compensated.py: one error step is 2^(E - 16), E the frexp
// exponent of the bf16 weight, at least -125), on the host: error_unit for every finite bf16 value against
// frexpf/ldexpf; join for every bf16 value and every error byte; split for every float within 64 ulps of every bf16
// value and 2^24 random bit patterns, against the same formulas spelled with frexpf/ldexpf.
// Usage: master_weights_check. Prints "checked N mismatches M" and the first mismatches; exit code 1 on any.
// Build: g++ -O2 -march=native -std=c++17 -Icsrc/include tests/native/master_weights_check.cpp
// (tests/kernels/test_master_weights_native.py; -DMASTER_CHECK_MUTANT builds its control, a unit off by one exponent
// for subnormal weights).
#include <cmath>
#include <cstdio>
#include <random>

#include "dsbnb/master_weights.h"

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
    for (uint32_t h = 0; h < (1u << 16); ++h) {  // around every bf16 value: where the rounding and the unit change
        for (int d = -64; d <= 64; ++d) check_split((h << 16) + static_cast<uint32_t>(d));
    }
    std::mt19937 rng(12345);
    for (int i = 0; i < (1 << 24); ++i) check_split(rng());
    std::printf("checked %llu mismatches %llu\n", c.checked, c.mismatches);
    return c.mismatches ? 1 : 0;
}
