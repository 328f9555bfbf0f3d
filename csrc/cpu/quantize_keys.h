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
// RunTable, the AVX-512 path's first resort, needs no look-up in memory at all: bnb's maps are runs of evenly spaced
// values (a decade each, then the next decade's coarser run), so between two "boundary" midpoints the count of
// midpoints below |u| is one FMA and a floor away from |u| (`codes = floor(min(|u|, top) * S + C)`, S, C and top per
// run and sign: `top` holds the line half a count past the run's last count, where it would otherwise overshoot up to
// the next boundary), the run found from |u|'s binary exponent (one boundary per octave at most, compared exactly).
// Values within a few ulps of a midpoint (their FMA's fraction below `band`; 0.2-0.4% of 16-value vectors of normal
// data) are settled by the key table instead. Built and checked on the host: a map whose midpoints are not such runs
// (a run's midpoints more than ~0.05 of its spacing off its line, two boundaries in one octave, more than 15
// boundaries, a run whose line misses its first count at its first value) leaves `usable` false and the kernels keep
// the key table. Held to the count of midpoints below, bit for bit, for every one of the 2^32 floats for bnb's two
// maps (key_table_check MAP.bin all). It made requantization 2.5x faster on a Zen 5 core (0.42M values: 0.19 -> 0.08
// ms), the gather having been about half of the AdamW step. Evaluating the line at min(|u|, top), where the count
// was clamped to the run's [lowest, highest] (two permutes, a max and a min), and settling a value on a boundary by
// the run it belongs to instead of the key table, made it ~12% faster again on a Zen 4 core (0.42M values, both
// maps: 0.315 -> 0.274 ms). Adam's second moment, whose values the update shows to be without a sign bit (the OR of
// their bits, one operation per 16), is quantized without the sign's four operations (adam8bit_avx512.h: Known):
// 12% faster on a Zen 5 core (0.5M values of the unsigned map, a throwaway harness: 95 -> 84 us), the AdamW kernel
// ~3% (0.42M elements, one thread, six alternating runs per build: median 1,295 -> 1,335 M elements/s).
// References: bitsandbytes 0.50.2 csrc/kernels.cu (dQuantizeDynamic), the quantizer it reproduces, and
// bitsandbytes/functional.py (create_dynamic_map), the maps' construction; Intel intrinsics guide (VPGATHERDD,
// VPERMT2D/VPERMT2PS, VCVTPS2DQ with embedded rounding, VREDUCEPS).
// Build and test: header-only, compiled into the CPU kernels (see adam8bit_cpu.cpp); pytest
// tests/kernels/test_key_table.py tests/kernels/test_fused_rules.py.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dsbnb/adam8bit.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dsbnb {
namespace cpu {

// How the vector paths find a value's code: on the AVX-512 path by the map's runs (RunTable, no look-up in memory;
// the default where the map has them), else by the key table, its entry fetched with one gather instruction per 16
// (AVX-512) or 8 (AVX2) values, or with one scalar load per value. All give the same codes; which is fastest depends
// on the CPU. Measured: with scalar loads the AdamW step ran at 0.89x the gather's rate on an AMD family-26 (Zen 5)
// core and at 0.60x on a 16-thread Xeon (the GPU proof's part o); where gathers are slow (Intel cores under the Gather
// Data Sampling microcode mitigation, for one) scalar loads may be faster.
// DEEPSPEED_BNB_CPU_KEY_LOOKUP=runs (default), gather or scalar (fused_cpu.h: choose_key_lookup, read at every operator
// call, before its threads start); gather and scalar skip the runs; the runs' rare near values take the gather.
enum class KeyLookup { kRuns, kGather, kScalar };
inline std::atomic<KeyLookup>& key_lookup() {
    static std::atomic<KeyLookup> chosen{KeyLookup::kRuns};
    return chosen;
}

constexpr int kKeyBits = 16;                        // the key: the top bits of the value's ordered integer
constexpr int32_t kKeyCenter = 1 << (kKeyBits - 1);  // entry of key 0 (ordered integers are signed)

// The quantizer of maps made of evenly spaced runs (header comment): per octave of |u| (binary exponents 96..127, the
// lowest one taking everything below), the run its bottom is in and the boundary inside it; per run and sign, the
// line whose floor is the count of midpoints below u. Built once per map on the host.
struct RunTable {
    static constexpr int kOctaves = 32;     // binary exponents 96..127 (|u| below 2^-31 joins the lowest)
    static constexpr int kFirstOctave = 96;
    static constexpr int kRuns = 16;        // per sign; the tables hold the positive runs, then the negative ones
    // |u| at or above 2 is taken as the largest float below 2 (one min instead of a compare; every midpoint is below)
    static constexpr uint32_t kClampBits = 0x3FFFFFFFu;
    static float clamp_magnitude() {
        float x;
        std::memcpy(&x, &kClampBits, sizeof(x));
        return x;
    }
    bool usable = false;                    // every check below held
    float band = 0.0f;                      // a line's fraction below this: settled by the key table
    alignas(64) int32_t first_run[kOctaves];  // octave -> the run its bottom is in (the boundaries below it)
    // octave -> the boundary magnitude inside it (+inf: none), as its bits: |u| above it is in the next run, and a
    // negative u on it too (the kernels compare |u|'s bits + 1 for u < 0), a positive u on it in the run below
    alignas(64) int32_t boundary[kOctaves];
    alignas(64) float slope[2 * kRuns];       // run (+ kRuns for u < 0, -0.0 included) -> S
    alignas(64) float offset[2 * kRuns];      // -> C: the count of midpoints below u is floor(min(|u|, top) * S + C)
    alignas(64) float top[2 * kRuns];         // -> the largest |u| the line is evaluated at (+inf: any)
    int32_t lowest[2 * kRuns];                // -> the counts the run takes (host checks only)
    int32_t highest[2 * kRuns];

    // `midpoints`: QuantTables::midpoints, 255 sorted fp32 midpoints (+inf after them).
    explicit RunTable(const float* midpoints) {
        std::vector<float> positive, negative;  // magnitudes, ascending
        for (int i = 0; i < 255; ++i) {
            const float m = midpoints[i];
            // a midpoint at zero, or at or above the clamp: not for lines
            if (!(std::fabs(m) < clamp_magnitude()) || m == 0.0f) return;
            (m > 0.0f ? positive : negative).push_back(std::fabs(m));
        }
        std::sort(negative.begin(), negative.end());
        // boundaries: on each side, runs of equal spacing taken greedily from the smallest magnitude; the midpoint
        // after a run (where the spacing changes, as between two of bnb's decades) is a boundary
        std::vector<float> bounds;
        for (const std::vector<float>* side : {&positive, &negative}) {
            const std::vector<float>& m = *side;
            for (size_t i = 0; i < m.size();) {
                size_t j = i;
                if (i + 1 < m.size()) {
                    const double spacing = static_cast<double>(m[i + 1]) - m[i];
                    for (j = i + 1; j + 1 < m.size() &&
                                    std::fabs((static_cast<double>(m[j + 1]) - m[j]) - spacing) <= 1e-3 * spacing;) {
                        ++j;
                    }
                }
                if (j + 1 < m.size()) bounds.push_back(m[j + 1]);
                i = j + 2;
            }
        }
        std::sort(bounds.begin(), bounds.end());
        bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
        if (bounds.size() >= kRuns) return;
        for (int o = 0; o < kOctaves; ++o) {
            const float low = o == 0 ? 0.0f : std::ldexp(1.0f, kFirstOctave + o - 127);
            const float high = std::ldexp(1.0f, kFirstOctave + o + 1 - 127);
            int below = 0, inside = 0;
            boundary[o] = bits_of(INFINITY);
            for (const float b : bounds) {
                if (b < low) {
                    ++below;
                } else if (b < high) {
                    ++inside;
                    boundary[o] = bits_of(b);
                }
            }
            if (inside > 1) return;  // one compare per octave decides the run
            first_run[o] = below;
        }
        for (int negative_side = 0; negative_side < 2; ++negative_side) {
            for (int run = 0; run < kRuns; ++run) {
                set_line(midpoints, bounds, negative_side ? negative : positive, negative_side ? -1 : 1, run,
                         run + kRuns * negative_side);
            }
        }
        // Each line's offset carries `shift`, so that a line value's fraction, not its distance to the nearer whole
        // number, says whether floor() is sure: one compare where two were. Why that is exact: the kernels' FMA is
        // monotone in |u|, so between two midpoints of a run u's line value lies between theirs; theirs lie within
        // [low, high] above the counts they separate (measured below in the kernels' arithmetic), so u's lies in
        // [count + low, count + 1 + high]. Where 0 < low and high < 1, a fraction above `high` has floor() = count;
        // before a run's first midpoint and after its last, set_ends checks the line. `shift` and `band` keep two
        // ulps of the largest line values to spare.
        double worst = 0.0;  // the largest distance of a midpoint's unshifted line value from its whole number
        each_midpoint_line(positive, negative, bounds, [&](double distance) {
            worst = std::max(worst, std::fabs(distance));
        });
        const float shift = static_cast<float>(worst) + std::ldexp(1.0f, -14);
        for (float& c : offset) c += shift;
        double low = 1.0, high = -1.0;  // the shifted line values' distance above their counts
        each_midpoint_line(positive, negative, bounds, [&](double distance) {
            low = std::min(low, distance);
            high = std::max(high, distance);
        });
        band = static_cast<float>(high) + std::ldexp(1.0f, -14);
        usable = low > 0.0 && band < 0.1f && set_ends(midpoints, bounds);
    }

    static int32_t bits_of(float x) {
        int32_t bits;
        std::memcpy(&bits, &x, sizeof(bits));
        return bits;
    }

  private:
    // The line in the kernels' arithmetic (one fp32 FMA) and its floor.
    float line(int slot, float magnitude) const { return std::fma(magnitude, slope[slot], offset[slot]); }
    int count_of(int slot, float magnitude) const { return static_cast<int>(std::floor(line(slot, magnitude))); }

    // Each run's ends, where no clamp of the count is left (the kernels have none): `top`, the magnitude at which the
    // line is half a count past the run's last one, and a check that the line gives the run's first count at the
    // run's first magnitude (or, for a decreasing line, a value within `band` above the next count, which the key
    // table settles). Why that covers a whole run: the line is monotone in |u|, so between the run's first magnitude
    // and its first midpoint it lies between those two ends' values (and the midpoints' own band, above, settles the
    // values next to that midpoint), and from its last midpoint to `top` and beyond (min(|u|, top)) it lies between
    // the last count + low and that count + 1/2. A negative u on a boundary is in the run above it (its
    // magnitude compared one ulp up), so its first magnitude is the boundary itself; a positive u on it is in the run
    // below (the count below a boundary excludes the boundary, as the run below's last count does). False when a
    // check fails (the kernels keep the key table).
    bool set_ends(const float* midpoints, const std::vector<float>& bounds) {
        for (int slot = 0; slot < 2 * kRuns; ++slot) {
            top[slot] = INFINITY;
            const bool negative = slot >= kRuns;
            float from, to;
            if (slope[slot] == 0.0f || !run_range(bounds, slot % kRuns, from, to)) continue;  // one count throughout
            const int first = negative ? highest[slot] : lowest[slot], last = negative ? lowest[slot] : highest[slot];
            const float start = (slot % kRuns == 0 || negative) ? from : std::nextafter(from, INFINITY);
            if (count_below(midpoints, negative ? -start : start) != first) return false;
            // a decreasing line (u < 0) may start just above first + 1: the values there are near, in the band
            const float at_start = line(slot, start);
            const int counted = count_of(slot, start);
            const bool near_above = negative && counted == first + 1 && at_start - std::floor(at_start) < band;
            if (counted != first && !near_above) return false;
            top[slot] = static_cast<float>((last + 0.5 - offset[slot]) / slope[slot]);
            if (!(top[slot] > from) || count_of(slot, top[slot]) != last) return false;
        }
        return true;
    }

    // The magnitudes between which run `run` lies (exclusive); false for a run past the last boundary's.
    static bool run_range(const std::vector<float>& bounds, int run, float& from, float& to) {
        if (run > static_cast<int>(bounds.size())) return false;
        from = run == 0 ? 0.0f : bounds[run - 1];
        to = run < static_cast<int>(bounds.size()) ? bounds[run] : INFINITY;
        return true;
    }

    // visit(line value - count) for every midpoint inside a run, its line as the kernels compute it (one fp32 FMA) and
    // the count of midpoints below the values just above it.
    template <typename Visit>
    void each_midpoint_line(const std::vector<float>& positive, const std::vector<float>& negative,
                            const std::vector<float>& bounds, Visit&& visit) const {
        for (int negative_side = 0; negative_side < 2; ++negative_side) {
            const std::vector<float>& side = negative_side ? negative : positive;
            const int direction = negative_side ? -1 : 1;  // below a negative u: the midpoints of larger magnitude
            for (int run = 0; run < kRuns; ++run) {
                const int slot = run + kRuns * negative_side;
                float from, to;
                if (!run_range(bounds, run, from, to)) continue;
                const int first = direction > 0 ? lowest[slot] : highest[slot];
                int k = 0;
                for (const float m : side) {
                    if (!(m > from && m < to)) continue;
                    const float x = std::fma(m, slope[slot], offset[slot]);
                    const int count = first + direction * (k + (direction > 0));  // above the k-th midpoint
                    visit(static_cast<double>(x) - count);
                    ++k;
                }
            }
        }
    }

    // The line of one run on one side (unshifted): its slope, offset and the counts it takes.
    void set_line(const float* midpoints, const std::vector<float>& bounds, const std::vector<float>& side,
                  int direction, int run, int slot) {
        slope[slot] = offset[slot] = 0.0f;
        lowest[slot] = highest[slot] = 0;
        float from, to;
        if (!run_range(bounds, run, from, to)) return;
        std::vector<float> inner;  // this side's midpoints strictly between the run's boundaries
        for (const float m : side) {
            if (m > from && m < to) inner.push_back(m);
        }
        const float start = run == 0 ? 0.0f : std::nextafter(from, INFINITY);  // just above the boundary
        const int first = count_below(midpoints, direction < 0 ? -start : start);
        const int n = static_cast<int>(inner.size());
        double s = 0.0, c = first + 0.5;  // no midpoint inside: the same count throughout
        if (n > 0) {
            // one step of the count per spacing, the first at inner[0]; one midpoint alone: a spacing as wide as the
            // run around it (`top` holds the count beyond)
            const double reach = (to < INFINITY ? to : 2.0) - static_cast<double>(inner[0]);
            const double spacing = n > 1 ? (static_cast<double>(inner[n - 1]) - inner[0]) / (n - 1)
                                         : 2.0 * std::max(static_cast<double>(inner[0]) - from, reach);
            s = direction / spacing;
            c = first + (direction > 0 ? 1.0 : 0.0) - s * inner[0];
        }
        slope[slot] = static_cast<float>(s);
        offset[slot] = static_cast<float>(c);
        lowest[slot] = std::min(first, first + direction * n);
        highest[slot] = std::max(first, first + direction * n);
    }
};

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
            const int below = count_below(midpoints, low);
            const int inside = count_below(midpoints, high) - below;
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
