// compact_quantizer_check.cpp — holds csrc/include/dsbnb/compact_quantizer.h's fast path to the literal searches it
// replaces, on the host: kTiesEven to bitsandbytes' quantize_2D (bnb_quantize_2d), kTiesLow to the count of fp32
// midpoints strictly below u (the project's IEEE rule, ops/reference.py). Also what the CUDA kernels' Selects shape
// (csrc/cuda/fused_step.cuh: quantize_bnb) relies on: the table looked up for every u, NaN included, stays in bounds
// and, with 0 chosen for a NaN after, gives quantize_2D's code; and for the sorted map the sign fix reads a code's sign
// bit off its index (bnb_cuda_math.h: sign_fix_sorted: the first `negatives` codes have it set).
// Usage: compact_quantizer_check MAP.bin [signed|unsigned] [near|all]
//   MAP.bin: the map's 256 float32 values; near (default): every float within 256 ulps of a midpoint, a map value, a
//   bucket edge or an exponent edge, special values and 2^24 random bit patterns; all: every one of the 2^32 floats.
// Prints one line "checked N mismatches M usable U entries E signs S" (S: codes whose sign bit the index rule gets
// wrong) and the first mismatches; exit code 1 on any mismatch.
// Build: g++ -O2 -std=c++17 -Icsrc/include tests/native/compact_quantizer_check.cpp
// (tests/kernels/test_compact_quantizer.py; -DCOMPACT_CHECK_MUTANT builds its control, which applies the wrong tie
// rule; -DCOMPACT_CHECK_SIGN_MUTANT one whose count of negative codes is one short; -DCOMPACT_CHECK_NAN_MUTANT one that
// keeps the table's answer for a NaN).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "native_check.h"

#include "dsbnb/compact_quantizer.h"

using dsbnb::compact::Table;

namespace {

struct Checker {
    const float* code;
    bool is_signed;
    const Table& table;
    uint64_t checked = 0, mismatches = 0;

    void check(uint32_t pattern) {
        const float u = dsbnb::compact::float_of(pattern);
        ++checked;
        // bnb's rule: the literal search (NaN included: it ends at entry 0)
        const int want_even = dsbnb::compact::bnb_quantize_2d(code, is_signed, u);
        // the Selects shape: the entry looked up whatever u is (in bounds for a NaN too), 0 chosen for a NaN after
        const int entry = dsbnb::compact::entry_of(u, table.e_lo, table.span);
        const bool in_bounds = entry >= 0 && entry < table.entries();
        const int looked_up = in_bounds ? dsbnb::compact::nearest<dsbnb::compact::kTiesEven>(u, table.lo, table.mid,
                                                                                               table.e_lo, table.span)
                                        : -1;
#ifdef COMPACT_CHECK_NAN_MUTANT  // a control: the table's answer kept for a NaN must be caught
        const int got_selects = looked_up;
#else
        const int got_selects = u != u ? 0 : looked_up;
#endif
#ifdef COMPACT_CHECK_MUTANT  // a control: the wrong tie rule must be caught
        const int got_even = u != u ? 0 : dsbnb::compact::nearest<dsbnb::compact::kTiesLow>(
                                              u, table.lo, table.mid, table.e_lo, table.span);
#else
        const int got_even = u != u ? 0 : dsbnb::compact::nearest<dsbnb::compact::kTiesEven>(
                                              u, table.lo, table.mid, table.e_lo, table.span);
#endif
        // the IEEE rule (NaN never reaches it: the kernels normalize it away first)
        int want_low = -1, got_low = -1;
        if (u == u) {
            want_low = static_cast<int>(std::lower_bound(table.mid, table.mid + 255, u) - table.mid);
            got_low = dsbnb::compact::nearest<dsbnb::compact::kTiesLow>(u, table.lo, table.mid, table.e_lo,
                                                                         table.span);
        }
        if (want_even != got_even || want_low != got_low || !in_bounds || got_selects != want_even) {
            if (++mismatches <= 10) {
                std::printf("mismatch at 0x%08x (%.9g): ties-even %d vs quantize_2D %d, ties-low %d vs %d, entry %d "
                            "of %d, selects %d\n", pattern, u, got_even, want_even, got_low, want_low, entry,
                            table.entries(), got_selects);
            }
        }
    }

};

}  // namespace

int main(int argc, char** argv) {
    float code[256];
    if (!native_check::map_argument(argc, argv, 3, "MAP.bin signed|unsigned [near|all]", code)) return 2;
    const bool is_signed = std::string(argv[2]) == "signed";
    const bool all = argc > 3 && std::string(argv[3]) == "all";
    static Table table(code);  // static: 8 KB of lo entries
    Checker c{code, is_signed, table};
    // the sign fix of the Selects shape: a usable table means a strictly ascending map in code order, whose codes with
    // the sign bit set are the first `negatives` ones (as the kernel counts them)
    int negatives = 0, signs = 0;
    for (int i = 0; i < 256; ++i) negatives += static_cast<int>(dsbnb::compact::bits_of(code[i]) >> 31);
#ifdef COMPACT_CHECK_SIGN_MUTANT  // a control: a count one short must be caught
    negatives -= 1;
#endif
    if (table.usable) {
        for (int i = 0; i < 256; ++i) signs += ((dsbnb::compact::bits_of(code[i]) >> 31) != 0) != (i < negatives);
    }
    const auto visit = [&c](uint32_t pattern) { c.check(pattern); };
    if (table.usable) {
        if (all) {
            for (uint64_t p = 0; p <= 0xFFFFFFFFull; ++p) c.check(static_cast<uint32_t>(p));
        } else {
            for (int i = 0; i < 255; ++i) native_check::around(table.mid[i], 256, visit);
            for (int i = 0; i < 256; ++i) native_check::around(code[i], 256, visit);
            for (int k = 0; k <= table.span; ++k) {  // bucket edges, and the ends of the exponent range
                native_check::around(dsbnb::compact::float_of(static_cast<uint32_t>((table.e_lo << 7) + k) << 16), 4,
                                     visit);
            }
            for (float x : {0.0f, 1e-45f, 1.17549435e-38f, 1.0f, 2.0f, 3.4028235e38f, INFINITY}) {
                native_check::around(x, 300, visit);
            }
            c.check(0x7FC00000u);  // NaNs
            c.check(0xFFC00000u);
            c.check(0x7F800001u);
            std::mt19937 rng(12345);
            for (int i = 0; i < (1 << 24); ++i) c.check(rng());
        }
    }
    std::printf("checked %llu mismatches %llu usable %d entries %d signs %d\n",
                static_cast<unsigned long long>(c.checked), static_cast<unsigned long long>(c.mismatches),
                table.usable ? 1 : 0, table.entries(), signs);
    return c.mismatches || signs ? 1 : 0;
}
