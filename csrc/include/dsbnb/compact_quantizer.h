// dsbnb/compact_quantizer.h — the nearest code of a normalized state value in a few instructions and a 6 KB table,
// for the CUDA kernels (the table lives in shared memory), with both tie rules the kernels need; and bitsandbytes'
// own search (quantize_2D), literally, which the fast path is proven equal to.
//
// What it does: for a 256-entry map sorted ascending, the nearest entry of u is `lo + (u beyond mid[lo])`, where lo
// counts the midpoints below the bucket holding u. A bucket is the set of floats sharing sign, exponent and the top 7
// mantissa bits (the top 16 bits of u), restricted to the exponents where the map has midpoints: below them every
// value rounds to the same entry (a "tiny" bucket per sign), above them too ("huge"). The host checks that no bucket
// holds two midpoints (bnb's dynamic maps hold at most one: 7 mantissa bits resolve their densest decade), that the
// map is strictly increasing, and that the table fits; a map that fails any check uses the literal search instead.
// Ties (u exactly on a midpoint): kTiesLow takes the lower entry (the project's IEEE rule, ops/reference.py);
// kTiesEven takes the entry of even sorted index, which is what bnb's quantize_2D returns (its binary search always
// ends on an even pivot and keeps the pivot on a tie); a NaN u gives entry 0 under bnb's rule.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (quantize_2D); torchao's branchless 8-step code search.
// Build: header only, host and device (no torch, no CUDA runtime). Test: tests/kernels/test_compact_quantizer.py
// compiles tests/native/compact_quantizer_check.cpp with g++ and compares both rules with the literal searches around
// every midpoint and map value, on special values and on random floats; tools/compact_quantizer_exhaustive.py compares
// all 2^32 floats for bnb's two maps (minutes).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSBNB_QHD __host__ __device__ __forceinline__
#else
#define DSBNB_QHD inline
#endif

namespace dsbnb {
namespace compact {

constexpr int kMaxKeys = 8192;  // table entries (both signs) a map may need for the fast path: 8 KB of uint8
enum Ties : int { kTiesLow = 0, kTiesEven = 1 };

DSBNB_QHD uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, sizeof(b));
    return b;
}

DSBNB_QHD float float_of(uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof(x));
    return x;
}

// The table entry of u: per sign, entry 0 is "tiny" (|u| below 2^(e_lo - 127)), entries 1..span the buckets from
// exponent e_lo on, entry span + 1 "huge" (infinities too); negative u takes the second half.
DSBNB_QHD int entry_of(float u, int e_lo, int span) {
    const uint32_t top = bits_of(u) >> 16;  // sign, 8 exponent bits, 7 mantissa bits
    const int magnitude = static_cast<int>(top & 0x7FFFu);
    int k = magnitude - (e_lo << 7);
    k = k < 0 ? -1 : (k >= span ? span : k);
    return static_cast<int>(top >> 15) * (span + 2) + k + 1;
}

// The sorted index of the entry nearest u (u not NaN), from the bucket's `lo` and the fp32 midpoints
// (mid[i] between sorted entries i and i + 1; mid[255] is NaN, which no u passes or equals).
template <int TieRule>
DSBNB_QHD int nearest(float u, const uint8_t* lo_table, const float* mid, int e_lo, int span) {
    const int lo = lo_table[entry_of(u, e_lo, span)];
    const float m = mid[lo];
    if (TieRule == kTiesEven) return lo + ((u > m || (u == m && (lo & 1))) ? 1 : 0);
    return lo + (u > m ? 1 : 0);
}

// bitsandbytes' quantize_2D<SIGNED> (csrc/kernels.cu), literally: a 7-step binary search over the 256-entry map
// `code` starting at pivot 127 (the first two steps read code[63], code[127], code[191], its "quadrants"), then the
// midpoint of the last two candidates; `lower`/`upper` start at -1 or 0 and at 1, not at map entries. Comparisons as
// compiled there (--use_fast_math): a subnormal x compares as zero, and the midpoints are (a + b) * 0.5 in fp32 with
// flush-to-zero (no midpoint of a bnb map is subnormal).
DSBNB_QHD int bnb_quantize_2d(const float* code, bool is_signed, float x) {
    if (x != 0.0f && std::fabs(x) < 1.17549435e-38f) x = std::copysign(0.0f, x);  // FSETP.FTZ: subnormals as zero
    int pivot = 127, upper_pivot = 255, lower_pivot = 0;
    float lower = is_signed ? -1.0f : 0.0f, upper = 1.0f, val = code[127];
    for (int i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = code[pivot];
    }
    if (x > val) {
        const float midpoint = (upper + val) * 0.5f;
        return x > midpoint ? upper_pivot : pivot;
    }
    const float midpoint = (lower + val) * 0.5f;
    return x < midpoint ? lower_pivot : pivot;
}

// The fast path's tables of one map, built on the host. `usable` false: the map fails a check (see the file
// comment) and the kernels use the literal search.
struct Table {
    bool usable = false;
    int e_lo = 0;            // first exponent (biased) with buckets of their own
    int span = 0;            // buckets per sign: 128 per exponent from e_lo to the last with a midpoint
    float mid[256];          // mid[i] = (sorted[i] + sorted[i + 1]) * 0.5f; mid[255] = NaN (a sentinel)
    uint8_t lo[kMaxKeys];    // per entry (entry_of): midpoints below the bucket's lowest value (the sorted index)
    int entries() const { return 2 * (span + 2); }

    // Builds the table of `code` (256 entries); usable only if the map is sorted strictly ascending, holds no NaN,
    // has no two midpoints in one bucket and none in a tiny or huge bucket, and fits kMaxKeys.
    explicit Table(const float* code) {
        for (int i = 0; i < 255; ++i) {
            if (!(code[i] < code[i + 1])) return;  // not strictly ascending (or NaN)
            mid[i] = (code[i] + code[i + 1]) * 0.5f;
        }
        mid[255] = NAN;
        int e_min = 255, e_max = 0;
        for (int i = 0; i < 255; ++i) {
            if (mid[i] == 0.0f) return;  // a midpoint at zero would sit between the two tiny buckets
            const int e = static_cast<int>((bits_of(mid[i]) >> 23) & 0xFFu);
            if (e == 0 || e == 255) return;  // subnormal or infinite midpoint
            e_min = e < e_min ? e : e_min;
            e_max = e > e_max ? e : e_max;
        }
        e_lo = e_min;
        span = (e_max - e_min + 1) << 7;
        if (entries() > kMaxKeys) return;
        for (int sign = 0; sign < 2; ++sign) {
            for (int k = -1; k <= span; ++k) {
                // the bucket's values, as ordered floats: [first, last] of its magnitudes
                const uint32_t first_magnitude = k < 0 ? 0u : static_cast<uint32_t>((e_lo << 7) + k) << 16;
                const uint32_t last_magnitude = k < 0 ? (static_cast<uint32_t>(e_lo << 7) << 16) - 1u
                                                : k == span ? 0x7F800000u  // up to +inf
                                                            : first_magnitude | 0xFFFFu;
                const float a = float_of(first_magnitude | (sign ? 0x80000000u : 0u));
                const float b = float_of(last_magnitude | (sign ? 0x80000000u : 0u));
                const float lowest = sign ? b : a, highest = sign ? a : b;
                int below = 0, inside = 0;
                for (int i = 0; i < 255; ++i) {
                    below += mid[i] < lowest ? 1 : 0;
                    inside += (mid[i] >= lowest && mid[i] <= highest) ? 1 : 0;
                }
                // a tiny or huge bucket must hold no midpoint; a regular one at most one
                if (inside > ((k < 0 || k == span) ? 0 : 1)) return;
                lo[sign * (span + 2) + k + 1] = static_cast<uint8_t>(below);
            }
        }
        usable = true;
    }
};

}  // namespace compact
}  // namespace dsbnb
