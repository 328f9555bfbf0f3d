// quantize_keys.h — the CPU quantizer's compact look-up for bnb-style maps: one table that takes a normalized value
// to the sorted index of its nearest map value with one look-up and one integer compare, shared by the portable loops
// (fused_cpu.h: quantize_block; lookup8 where the compiler targets AVX2, lookup elsewhere) and the AVX-512 path
// (adam8bit_avx512.h: quantize16, one gather per 16 values).
//
// Why: the generic look-up (dsbnb::QuantTables, 16-bit keys) needs two tables of 256 KiB each, so two reads per
// value; bnb's maps need neither the separate split table nor the code table. Here the key is the top 16 bits of the
// value's order-preserving integer (sign, exponent, 7 mantissa bits): one shift, no clamp, the table indexed from its
// middle (256 KiB, of which the rows of |u| in [1e-8, 1], about 28 KiB, are the ones a step reads). Each bucket holds
// at most one midpoint (checked when the table is built, else `usable` is false and the generic look-up runs); its
// packed entry is the sorted index below the bucket and the top 24 bits of that midpoint as an ordered integer. The
// value's own top 24 bits decide above/below; values that share those 24 bits with the midpoint (~1/256 of them) are
// settled by an exact fp32 compare. Same answer as the count of midpoints below the value for every fp32 value but
// NaN, bit for bit (tests/kernels/test_key_table.py: every spelling, near every midpoint and bucket edge; all 2^32
// floats with `key_table_check MAP.bin all`).
// Where the time goes (AdamW, 0.44M elements, 1 thread, AVX-512 on an AMD family-26 (Zen 5) core, perf): requantizing
// the two moments is about two thirds of the step, the 16-lane VPGATHERDD about half of that; the earlier 13-bit key
// (exponent clamped to 32 rows, the sign moved next to it: seven more vector operations per 16 values) made the step
// ~8% slower. Looking the entries up with scalar loads instead of the gather, in a pass of their own, gained ~2%.
// References: bitsandbytes 0.50.2 csrc/kernels.cu (dQuantizeDynamic), the quantizer it reproduces; Intel intrinsics
// guide (VPGATHERDD).
// Build and test: header-only, compiled into the CPU kernels (see adam8bit_cpu.cpp); pytest
// tests/kernels/test_key_table.py tests/kernels/test_fused_rules.py.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dsbnb/adam8bit.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dsbnb {
namespace cpu {

// How the vector paths look a key's entry up: one gather instruction per 16 (AVX-512) or 8 (AVX2) values, the default,
// or one scalar load per value. Both read the same entries, so the codes are the same; which is faster depends on
// the CPU. The gather on both measured: with scalar loads the AdamW step ran at 0.89x its rate on an AMD family-26
// (Zen 5) core and at 0.60x on a 16-thread Xeon (the GPU proof's part o); where gathers are slow (Intel cores under
// the Gather Data Sampling microcode mitigation, for one) scalar loads may be faster.
// DEEPSPEED_BNB_CPU_KEY_LOOKUP=scalar selects them (fused_cpu.h: choose_key_lookup, read at every operator call,
// before its threads start); the GPU proof's part o times both on its host.
enum class KeyLookup { kGather, kScalar };
inline std::atomic<KeyLookup>& key_lookup() {
    static std::atomic<KeyLookup> chosen{KeyLookup::kGather};
    return chosen;
}

constexpr int kKeyBits = 16;                        // the key: the top bits of the value's ordered integer
constexpr int32_t kKeyCenter = 1 << (kKeyBits - 1);  // entry of key 0 (ordered integers are signed)

// The compact quantizer table of one 256-entry map; built once per map on the host.
struct KeyTable {
    bool usable = false;  // map sorted ascending (codes are sorted indices), every bucket holds at most one midpoint
    // key + kKeyCenter -> the top 24 bits of the bucket's midpoint as an ordered integer | the sorted index below the
    // bucket (no midpoint: a top no value reaches)
    alignas(64) uint32_t packed[1 << kKeyBits];

    explicit KeyTable(const QuantTables& generic) {
        const float* midpoints = generic.midpoints;
        usable = true;
        for (int i = 0; i < 256; ++i) usable &= generic.order[i] == i;  // codes are sorted indices (bnb's maps)
        const int32_t lowest = ordered(-INFINITY), highest = ordered(INFINITY);  // no NaN bucket edges
        for (int32_t key = -kKeyCenter; key < kKeyCenter && usable; ++key) {
            // the bucket: every float whose ordered integer has these top bits; a midpoint counts for a value u of
            // it when it is below u, so the midpoints in [low, high) decide (one equal to high counts for none)
            const int32_t first = static_cast<int32_t>(static_cast<uint32_t>(key) << 16);
            const float low = from_ordered(std::min(std::max(first, lowest), highest));
            const float high = from_ordered(std::min(std::max(first | 0xFFFF, lowest), highest));
            const int below = static_cast<int>(std::lower_bound(midpoints, midpoints + 255, low) - midpoints);
            const int inside =
                static_cast<int>(std::lower_bound(midpoints, midpoints + 255, high) - midpoints) - below;
            usable &= inside <= 1;
            uint32_t split_top = 0x7FFFFF00u;  // no midpoint: every value of the bucket is "below"
            // a midpoint of -0.0 is split as +0.0: the integer order puts -0.0 below +0.0, fp32 compares them equal
            // (such a value lands on the split and is settled by the exact compare)
            if (inside == 1) split_top = static_cast<uint32_t>(ordered(midpoints[below] + 0.0f)) & ~0xFFu;
            packed[key + kKeyCenter] = split_top | static_cast<uint32_t>(below);
        }
    }

    // The float's bits as an int32 that orders like the float (negatives flipped below the sign bit); its own inverse.
    static int32_t ordered(float x) {
        int32_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        return bits ^ ((bits >> 31) & 0x7FFFFFFF);
    }
    static float from_ordered(int32_t order) {
        const int32_t bits = order ^ ((order >> 31) & 0x7FFFFFFF);
        float x;
        std::memcpy(&x, &bits, sizeof(x));
        return x;
    }

    // The entries, indexed by the key itself (order >> 16, signed).
    const int32_t* centered() const { return reinterpret_cast<const int32_t*>(packed) + kKeyCenter; }

    // The sorted index of the map value nearest to u (not NaN), or (near = true) of the value just below the bucket's
    // midpoint when u shares its top 24 bits with it: the caller then settles u exactly. Plain integer code.
    int lookup(float u, bool& near) const {
        const int32_t order = ordered(u);
        const int32_t entry = centered()[order >> 16];
        const int32_t top = order >> 8, split = entry >> 8;
        near = top == split;
        return (entry & 0xFF) + (top > split ? 1 : 0);
    }

#if defined(__AVX2__)
    // lookup() for 8 normalized values, with an explicit gather: gcc's own vectorization of lookup() on AVX2 CPUs
    // spells the gather as 8 extract/insert pairs (its tuning for AMD Zen avoids VPGATHERDD), ~1.7x slower here.
    // Stores the 8 sorted indices as bytes; returns the near lanes as a bit mask. `scalar`: the entries by scalar
    // loads instead of the gather (KeyLookup).
    int lookup8(__m256 u, uint8_t* out, bool scalar = false) const {
        const __m256i bits = _mm256_castps_si256(u);
        const __m256i order = _mm256_xor_si256(bits, _mm256_and_si256(_mm256_srai_epi32(bits, 31),
                                                                       _mm256_set1_epi32(0x7FFFFFFF)));
        __m256i entry;
        if (scalar) {
            alignas(32) int32_t key[8], found[8];
            _mm256_store_si256(reinterpret_cast<__m256i*>(key), _mm256_srai_epi32(order, 16));
            for (int i = 0; i < 8; ++i) found[i] = centered()[key[i]];
            entry = _mm256_load_si256(reinterpret_cast<const __m256i*>(found));
        } else {
            entry = _mm256_i32gather_epi32(centered(), _mm256_srai_epi32(order, 16), 4);
        }
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
