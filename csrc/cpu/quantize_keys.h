// quantize_keys.h — the CPU quantizer's compact look-up for bnb-style maps: one 32 KiB table (L1-resident) that takes a
// normalized value to the sorted index of its nearest map value with one look-up and one integer compare, shared by
// the portable loops (fused_cpu.h: quantize_block; lookup8 where the compiler targets AVX2, lookup elsewhere) and
// the AVX-512 path (adam8bit_avx512.h: quantize16, one gather per 16 values).
//
// Why: the generic look-up (dsbnb::QuantTables, 16-bit keys) needs two tables of 256 KiB each, so two L2-bound reads
// per value; bnb's maps need neither that many key bits nor the separate code table. Here a 13-bit key (sign, the
// exponent clamped to the map's range, 7 mantissa bits) selects a bucket holding at most one midpoint (checked when
// the table is built, else `usable` is false and the generic look-up runs); its packed entry is the sorted index below
// the bucket and the top 24 bits of that midpoint as an order-preserving integer. The value's own top 24 bits decide
// above/below; values that share those 24 bits with the midpoint (~1/256 of them) are settled by the exact
// dsbnb::nearest_sorted. Same answer as dsbnb::nearest_sorted for every fp32 value, bit for bit
// (tests/kernels/test_fused_rules.py, including maps the table must refuse and values on and next to midpoints).
// Where the time goes (AdamW, 4M elements, 1 thread, AVX2 Zen 3, perf): requantizing the two moments is about half of
// the step, and the 8-lane VPGATHERDD about half of that; dequantization (scalar loads) and the update the rest.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (dQuantizeDynamic), the quantizer it reproduces; Intel intrinsics
// guide (VPGATHERDD).
// Build and test: header-only, compiled into the CPU kernels (see adam8bit_cpu.cpp); pytest
// tests/kernels/test_fused_rules.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dsbnb/adam8bit.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dsbnb {
namespace cpu {

constexpr int kKeyMantissaBits = 7;   // mantissa bits in the key
constexpr int kKeyExponentSpan = 32;  // exponents kept below 2^0 (smaller magnitudes share the lowest bucket row)
constexpr int kKeyMaxExponent = 127;  // biased exponent of 1.0: normalized values never exceed it (|u| <= 1)

// The compact quantizer table of one 256-entry map; built once per map on the host.
struct KeyTable {
    bool usable = false;   // map sorted ascending (codes are sorted indices), every bucket holds at most one midpoint
    int low_exponent = 0;  // smallest biased exponent the key keeps; smaller magnitudes use its row (no midpoint)
    alignas(64) uint32_t packed[2 * kKeyExponentSpan << kKeyMantissaBits];  // key -> midpoint's top 24 bits | index

    explicit KeyTable(const QuantTables& generic) {
        const float* midpoints = generic.midpoints;
        usable = true;
        for (int i = 0; i < 256; ++i) usable &= generic.order[i] == i;  // codes are sorted indices (bnb's maps)
        float smallest = INFINITY;
        for (int i = 0; i < 255; ++i) smallest = std::fmin(smallest, std::fabs(midpoints[i]));
        int exponent = 0;
        std::frexp(smallest, &exponent);  // smallest = f * 2^exponent, f in [0.5, 1): biased exponent 126 + exponent
        // one exponent row below the smallest midpoint's, so the lowest row (which also takes all smaller values,
        // zero included) holds no midpoint
        low_exponent = std::max(126 + exponent - 1, kKeyMaxExponent - kKeyExponentSpan + 1);
        usable &= smallest > 0.0f;
        const int rows = kKeyMaxExponent - low_exponent + 1;
        for (uint32_t sign = 0; sign < 2 && usable; ++sign) {
            for (int row = 0; row < rows; ++row) {
                for (uint32_t mantissa = 0; mantissa < (1u << kKeyMantissaBits); ++mantissa) {
                    const uint32_t top = sign << 31 | uint32_t(low_exponent + row) << 23 | mantissa << 16;
                    const uint32_t low_bits = top | (sign ? 0xFFFFu : 0u), high_bits = top | (sign ? 0u : 0xFFFFu);
                    float low, high;
                    std::memcpy(&low, &low_bits, sizeof(low));
                    std::memcpy(&high, &high_bits, sizeof(high));
                    if (row == 0) (sign ? high : low) = sign ? -0.0f : 0.0f;  // the row also takes smaller values
                    if (row == rows - 1) (sign ? low : high) = sign ? -INFINITY : INFINITY;  // and larger ones
                    const int below = static_cast<int>(std::lower_bound(midpoints, midpoints + 255, low) - midpoints);
                    const int inside =
                        static_cast<int>(std::lower_bound(midpoints, midpoints + 255, high) - midpoints) - below;
                    const bool edge = row == 0 || row == rows - 1;
                    usable &= inside <= (edge ? 0 : 1);
                    // no midpoint: a top no value reaches, so every value of the bucket is "below"
                    uint32_t split_top = 0x7FFFFF00u;
                    if (inside == 1) split_top = static_cast<uint32_t>(ordered(midpoints[below])) & ~0xFFu;
                    packed[key(sign, row, mantissa)] = split_top | static_cast<uint32_t>(below);
                }
            }
        }
    }

    static uint32_t key(uint32_t sign, int row, uint32_t mantissa) {
        return sign << 12 | static_cast<uint32_t>(row) << kKeyMantissaBits | mantissa;
    }

    // The float's bits as an int32 that orders like the float (negatives flipped below the sign bit).
    static int32_t ordered(float x) {
        int32_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        return bits ^ ((bits >> 31) & 0x7FFFFFFF);
    }

    // The sorted index of the map value nearest to u, or (near = true) of the value just below the bucket's midpoint
    // when u shares its top 24 bits with it: the caller then settles u exactly. Plain integer code: vectorizable.
    int lookup(float u, bool& near) const {
        uint32_t bits;
        std::memcpy(&bits, &u, sizeof(bits));
        // key: sign at bit 12; exponent and 7 mantissa bits clamped to the kept rows (a value outside them lands in
        // an edge row, which holds no midpoint, so any of its buckets gives the right answer), rebased to row 0
        const uint32_t lowest = static_cast<uint32_t>(low_exponent) << kKeyMantissaBits;
        const uint32_t highest = static_cast<uint32_t>(kKeyMaxExponent) << kKeyMantissaBits | 0x7Fu;
        const uint32_t magnitude = std::min(std::max((bits >> 16) & 0x7FFFu, lowest), highest);
        const int32_t entry = static_cast<int32_t>(packed[((bits >> 19) & (1u << 12)) | (magnitude - lowest)]);
        const int32_t top = ordered(u) >> 8, split = entry >> 8;
        near = top == split;
        return (entry & 0xFF) + (top > split ? 1 : 0);
    }

#if defined(__AVX2__)
    // lookup() for 8 normalized values, with an explicit gather: gcc's own vectorization of lookup() on AVX2 CPUs
    // spells the gather as 8 extract/insert pairs (its tuning for AMD Zen avoids VPGATHERDD), ~1.7x slower here.
    // Stores the 8 sorted indices as bytes; returns the near lanes as a bit mask.
    int lookup8(__m256 u, uint8_t* out) const {
        const __m256i bits = _mm256_castps_si256(u);
        const __m256i lowest = _mm256_set1_epi32(low_exponent << kKeyMantissaBits);
        const __m256i magnitude = _mm256_min_epi32(
            _mm256_max_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x7FFF)), lowest),
            _mm256_set1_epi32(kKeyMaxExponent << kKeyMantissaBits | 0x7F));
        const __m256i key = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(bits, 19), _mm256_set1_epi32(1 << 12)),
                                            _mm256_sub_epi32(magnitude, lowest));
        const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(packed), key, 4);
        const __m256i order = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31),
                                                                       _mm256_set1_epi32(0x7FFFFFFF)));
        const __m256i split = _mm256_srai_epi32(entry, 8), top = _mm256_srai_epi32(order, 8);
        // index + (top > split): the compare is all ones (-1) where true
        const __m256i index = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xFF)),
                                               _mm256_cmpgt_epi32(top, split));
        // the low byte of each 32-bit lane, in order
        const __m256i bytes = _mm256_shuffle_epi8(index, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                          -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                                                          -1, -1, -1, -1, -1, -1, -1, -1));
        const uint32_t low = static_cast<uint32_t>(_mm256_cvtsi256_si32(bytes));
        const uint32_t high = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
        std::memcpy(out, &low, 4);
        std::memcpy(out + 4, &high, 4);
        return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(top, split)));
    }
#endif
};

}  // namespace cpu
}  // namespace dsbnb
