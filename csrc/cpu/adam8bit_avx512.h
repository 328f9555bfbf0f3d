// adam8bit_avx512.h — the CPU kernels' full-block path in AVX-512 (F, BW, DQ; VBMI) intrinsics: the two look-ups,
// which cost more than all of the arithmetic when the compiler turns them into gathers (measured on AMD Zen 4: one
// 16-lane gather ~15 cycles; six of them per 16 elements made 70% of the step), and the update between them, kept
// in registers from dequantization to the new state: update_block (AdamW, adam8bit_cpu.cpp), lion_update_block
// (Lion, lion8bit_cpu.cpp) and momentum_update_block (SGD momentum, momentum8bit_cpu.cpp) share dequantize64,
// quantize16 and load_grad16.
//
// - dequantize: qmap[code] for 64 codes at once without a gather. The 256-entry fp32 map is held as four byte planes
//   (byte k of every entry); each plane is looked up with two 128-byte VPERMI2B permutes and a blend on the code's top
//   bit, and the planes are interleaved back into floats. The interleave leaves element i of each 16-lane lane group
//   transposed, so the codes are permuted first (one VPERMB) to land every float in order. That needs VBMI (Ice Lake
//   and later, AMD Zen 4 and later); AVX-512 cores without it (Skylake-SP, Cascade Lake: many A100 hosts) look each
//   of the map's eight runs of 32 floats up with VPERMT2PS and choose among them by the code's top three bits. On
//   this project's Zen 5 core, compiled for x86-64-v4, that made AdamW 1.55x as fast as the AVX2 loops the build
//   fell back to before (0.66 -> 0.42-0.43 ms, 0.42M elements, one thread) and 0.8x the VBMI spelling's rate.
// - quantize: the index of the nearest map value, for 16 values without a look-up in memory where the map is made of
//   evenly spaced runs (bnb's are: quantize_keys.h, RunTable): a few in-register permutes, one FMA and a floor; the
//   rare values that this cannot settle, and other maps, by one gather from the compact key table (KeyTable), whose
//   own near values an exact fp32 compare settles. Same answer as dsbnb::nearest_sorted, bit for bit.
//
// Both are exact table look-ups, so the kernels stay bit-identical to deepspeed_bnb/ops/reference.py
// (tests/kernels/test_fused_rules.py, every rule of the registry, including maps the fast path must refuse
// and values on and next to midpoints; tests/kernels/test_dequantize_spellings.py holds the dequantizer's other
// spelling). Used only when the compiler targets these extensions (-march=native on such a CPU: the JIT build);
// otherwise the portable loops in adam8bit_cpu.cpp, lion8bit_cpu.cpp, momentum8bit_cpu.cpp and
// fused_cpu.h run.
// References: Intel intrinsics guide (VPERMI2B, VPERMB, VPERMT2D/VPERMT2PS, VRNDSCALEPS, VPGATHERDD, VFPCLASSPS,
// VRANGEPS); bitsandbytes 0.50.2 csrc/kernels.cu (dQuantizeDynamic) for the quantizer it reproduces.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)  // every AVX-512 server core
#define DSBNB_AVX512 1
#if defined(__AVX512VBMI__)
#define DSBNB_AVX512_VBMI 1  // dequantize64 by byte permutes; without VBMI, by 32-entry float permutes
#endif
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dsbnb/adam8bit.h"
#include "quantize_keys.h"

namespace dsbnb {
namespace avx512 {

// One 256-entry map for dequantize64; built once per map on the host.
struct FastTables {
    alignas(64) uint8_t planes[4][256];  // planes[k][code] = byte k of qmap[code] (little endian): the VBMI spelling
    alignas(64) float values[256];       // qmap itself: the spelling without VBMI

    explicit FastTables(const float* qmap) {
        std::memcpy(values, qmap, sizeof(values));
        for (int code = 0; code < 256; ++code) {
            uint32_t word;
            std::memcpy(&word, &qmap[code], sizeof(word));
            for (int k = 0; k < 4; ++k) planes[k][code] = static_cast<uint8_t>(word >> (8 * k));
        }
    }
};

// out[i] = qmap[codes[i]] * scale for 64 codes, as four vectors of 16 in order.
__attribute__((always_inline)) inline void dequantize64(const FastTables& t, const uint8_t* codes, float scale,
                                                       __m512 out[4]) {
#if !DSBNB_AVX512_VBMI
    // Without byte permutes (AVX-512 CPUs before Ice Lake: Skylake-SP, Cascade Lake): each of the map's eight runs of
    // 32 entries looked up by the code's low 5 bits (VPERMT2PS), then one of the eight chosen by its bits 5, 6 and 7;
    // no gather (slow under the Gather Data Sampling mitigation those cores take)
    const __m512 s = _mm512_set1_ps(scale);
    for (int k = 0; k < 4; ++k) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k)));
        __m512 part[8];
        for (int j = 0; j < 8; ++j) {
            const float* run = t.values + 32 * j;
            part[j] = _mm512_permutex2var_ps(_mm512_load_ps(run), c, _mm512_load_ps(run + 16));
        }
        for (int bit = 5, n = 8; bit < 8; ++bit, n /= 2) {
            const __mmask16 upper = _mm512_test_epi32_mask(c, _mm512_set1_epi32(1 << bit));
            for (int j = 0; j < n / 2; ++j) part[j] = _mm512_mask_blend_ps(upper, part[2 * j], part[2 * j + 1]);
        }
        out[k] = _mm512_mul_ps(part[0], s);
    }
#else
    // element e of the output sits, after the byte interleave below, at byte (e % 16 / 4) * 16 + e / 16 * 4 + e % 4
    // of the permuted codes: a 4x4 transpose of 4-byte groups, undone up front
    alignas(64) static const uint8_t transpose[64] = {
        0, 1, 2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,  //
        4, 5, 6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,  //
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,  //
        12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i c = _mm512_permutexvar_epi8(_mm512_load_si512(transpose), _mm512_loadu_si512(codes));
    const __mmask64 upper = _mm512_movepi8_mask(c);  // code >= 128: the upper half of the map
    __m512i plane[4];
    for (int k = 0; k < 4; ++k) {
        const __m512i* p = reinterpret_cast<const __m512i*>(t.planes[k]);
        const __m512i lower_half = _mm512_permutex2var_epi8(_mm512_load_si512(p), c, _mm512_load_si512(p + 1));
        const __m512i upper_half = _mm512_permutex2var_epi8(_mm512_load_si512(p + 2), c, _mm512_load_si512(p + 3));
        plane[k] = _mm512_mask_blend_epi8(upper, lower_half, upper_half);
    }
    const __m512i b01_low = _mm512_unpacklo_epi8(plane[0], plane[1]);
    const __m512i b01_high = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i b23_low = _mm512_unpacklo_epi8(plane[2], plane[3]);
    const __m512i b23_high = _mm512_unpackhi_epi8(plane[2], plane[3]);
    const __m512 s = _mm512_set1_ps(scale);
    out[0] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_low, b23_low)), s);
    out[1] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_low, b23_low)), s);
    out[2] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_high, b23_high)), s);
    out[3] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_high, b23_high)), s);
#endif
}

// A RunTable in registers (quantize_keys.h): its 32-entry tables as two vectors each, loaded once per block rather than
// once per 16 values (the codes are stored through a byte pointer, which may alias the table, so the compiler would
// otherwise read them again after every store).
struct RunRegisters {
    bool usable;
    __m512i first[2], boundary[2];
    __m512 slope[2], offset[2], top[2], band;

    explicit RunRegisters(const cpu::RunTable& r) : usable(r.usable) {
        for (int k = 0; k < 2; ++k) {
            first[k] = _mm512_load_si512(r.first_run + 16 * k);
            boundary[k] = _mm512_load_si512(r.boundary + 16 * k);
            slope[k] = _mm512_load_ps(r.slope + 16 * k);
            offset[k] = _mm512_load_ps(r.offset + 16 * k);
            top[k] = _mm512_load_ps(r.top + 16 * k);
        }
        band = _mm512_set1_ps(r.band);
    }
};

// The sorted indices of 16 normalized values by the map's runs (quantize_keys.h: RunTable): the run from |u|'s
// octave and that octave's boundary, then floor(min(|u|, top) * S + C) (|u| >= 2 taken as the largest float below 2:
// the same count). Returns the lanes this cannot settle (the line's fraction below `band`), for the key table. `u` is
// not NaN (normalize() has replaced it). kNonNegative: the caller knows that no u has its sign bit set (-0.0 neither),
// so the sign's four operations (its mask, the magnitude's bits, the negative runs' offset, the boundary's ulp) are
// left out: the same index for such u.
template <bool kNonNegative>
__attribute__((always_inline)) inline __mmask16 run_index16(const RunRegisters& r, __m512 u, __m512i& index) {
    const __m512i bits = _mm512_castps_si512(u);
    // -1 where u < 0 (-0.0 included), else 0
    const __m512i negative = kNonNegative ? _mm512_setzero_si512() : _mm512_srai_epi32(bits, 31);
    const __m512i magnitude_bits = _mm512_min_epu32(
        kNonNegative ? bits : _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
        _mm512_set1_epi32(cpu::RunTable::kClampBits));
    const __m512 magnitude = _mm512_castsi512_ps(magnitude_bits);
    // the octave's table index: the permutes read its low 5 bits, exponents 96..127 give 0..31
    const __m512i octave = _mm512_max_epi32(_mm512_srli_epi32(magnitude_bits, 23),
                                            _mm512_set1_epi32(cpu::RunTable::kFirstOctave));
    // the run: the octave's first, + kRuns for u < 0, + 1 above the octave's boundary (magnitudes order as their
    // bits; a negative u on the boundary too: its magnitude compared one ulp up)
    __m512i run = _mm512_permutex2var_epi32(r.first[0], octave, r.first[1]);
    if (!kNonNegative) run = _mm512_add_epi32(run, _mm512_and_si512(negative, _mm512_set1_epi32(cpu::RunTable::kRuns)));
    const __m512i boundary = _mm512_permutex2var_epi32(r.boundary[0], octave, r.boundary[1]);
    const __mmask16 above = _mm512_cmpgt_epi32_mask(
        kNonNegative ? magnitude_bits : _mm512_sub_epi32(magnitude_bits, negative), boundary);
    run = _mm512_mask_add_epi32(run, above, run, _mm512_set1_epi32(1));
    const __m512 slope = _mm512_permutex2var_ps(r.slope[0], run, r.slope[1]);
    const __m512 offset = _mm512_permutex2var_ps(r.offset[0], run, r.offset[1]);
    const __m512 top = _mm512_permutex2var_ps(r.top[0], run, r.top[1]);
    const __m512 line = _mm512_fmadd_ps(_mm512_min_ps(magnitude, top), slope, offset);
    index = _mm512_cvt_roundps_epi32(line, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    // line - floor(line), exact (VREDUCEPS)
    const __m512 fraction = _mm512_reduce_ps(line, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_cmp_ps_mask(fraction, r.band, _CMP_LT_OQ);
}

// How a quantizer applies dsbnb::floor_positive (Adam's second moment). kLift: the code of 0 lifted to the smallest
// positive one where x > 0, as floor_positive says. kMax: max(index, smallest) where x > 0, the same codes in two
// operations instead of four where every x > 0 has an index at or above 0's and the smallest positive value is the
// next one (floor_kind checks both on the host).
enum class Floor { kNone, kLift, kMax };

inline Floor floor_kind(const PositiveFloor& floor, const float* midpoints) {
    if (floor.zero < 0) return Floor::kNone;
    // the count of midpoints below any u >= +0 is at least `zero` when the midpoint below 0's code is negative
    const bool below_zero = floor.zero == 0 || midpoints[floor.zero - 1] < 0.0f;
    return below_zero && floor.smallest == floor.zero + 1 ? Floor::kMax : Floor::kLift;
}

// What the caller of a quantizer knows about the values it quantizes, x * reciprocal_absmax: nothing (normalize()'s
// test runs), that none is NaN (x finite, reciprocal_absmax finite: the test is skipped), or that besides none has its
// sign bit set (x >= +0 and reciprocal_absmax > 0, as Adam's second moment is: run_index16 leaves the sign out).
enum class Known { kNothing, kFinite, kFiniteNonNegative };

// The sorted indices of the nearest codes to normalize(x[i], reciprocal_absmax) for 16 values: dsbnb::normalize then
// nearest_sorted, by the map's runs (run_index16) where kLookup is KeyLookup::kRuns (the caller has checked that the
// map has them), else (and for the lanes the runs leave) by the compact key table (quantize_keys.h: KeyTable::lookup,
// 16 lanes at once); then dsbnb::floor_positive as kFloor says (Adam's second moment: `floor`) in the same registers.
// kKnown: what the caller knows of the values (Known). KeyLookup::kScalar: the key entries by scalar loads instead of
// the gather (the same entries). The lookup, floor and knowledge are template arguments so that a block's loop over
// 16 values carries no test of them (quantize_full_block chooses once per block); inlined, so that its constants are
// hoisted out of that loop.
template <cpu::KeyLookup kLookup, Floor kFloor, Known kKnown>
__attribute__((always_inline)) inline __m512i quantize16_as(const cpu::KeyTable& t, const RunRegisters& runs,
                                                           const float* midpoints, const float* x,
                                                           float reciprocal_absmax, PositiveFloor floor) {
    const __m512 value = _mm512_loadu_ps(x);
    __m512 u = _mm512_mul_ps(value, _mm512_set1_ps(reciprocal_absmax));
    const __mmask16 unordered = kKnown != Known::kNothing ? 0 : _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
    if (unordered) {  // normalize(): inf * 0 -> sign of x, NaN x -> 0
        const __m512i sign = _mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32(INT32_MIN));
        u = _mm512_mask_mov_ps(u, unordered, _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_castps_si512(
                                                                                             _mm512_set1_ps(1.0f)))));
        u = _mm512_mask_mov_ps(u, unordered & _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), _mm512_setzero_ps());
    }
    __m512i index;
    if (kLookup != cpu::KeyLookup::kRuns || run_index16<kKnown == Known::kFiniteNonNegative>(runs, u, index)) {
        // the key: the top 16 bits of the value's ordered integer (signed; the table is indexed from its middle)
        const __m512i bits = _mm512_castps_si512(u);
        const __m512i order = _mm512_xor_si512(bits, _mm512_and_si512(_mm512_srai_epi32(bits, 31),
                                                                       _mm512_set1_epi32(0x7FFFFFFF)));
        __m512i entry;
        if (kLookup == cpu::KeyLookup::kScalar) {
            alignas(64) int32_t key[16], found[16];
            _mm512_store_si512(key, _mm512_srai_epi32(order, 16));
            for (int i = 0; i < 16; ++i) found[i] = t.centered()[key[i]];
            entry = _mm512_load_si512(found);
        } else {
            entry = _mm512_i32gather_epi32(_mm512_srai_epi32(order, 16), t.centered(), 4);
        }
        // compare the value's ordered top 24 bits with the midpoint's: above, below, or too close to tell
        const __m512i split = _mm512_srai_epi32(entry, 8), top = _mm512_srai_epi32(order, 8);
        const __m512i one = _mm512_set1_epi32(1);
        index = _mm512_and_si512(entry, _mm512_set1_epi32(0xFF));
        index = _mm512_mask_add_epi32(index, _mm512_cmpgt_epi32_mask(top, split), index, one);
        const __mmask16 near = _mm512_cmpeq_epi32_mask(top, split);
        if (near) {  // within 256 ulps of the midpoint (~1/256 of values): the exact compare, as nearest_sorted does
            const __m512 midpoint = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), near, index, midpoints, 4);
            index = _mm512_mask_add_epi32(index, _mm512_mask_cmp_ps_mask(near, midpoint, u, _CMP_LT_OQ), index, one);
        }
    }
    const __mmask16 positive = _mm512_cmp_ps_mask(value, _mm512_setzero_ps(), _CMP_GT_OQ);
    if (kFloor == Floor::kMax) {
        index = _mm512_mask_max_epi32(index, positive, index, _mm512_set1_epi32(floor.smallest));
    } else if (kFloor == Floor::kLift) {  // a positive value whose nearest code is 0's takes the smallest positive code
        const __mmask16 lifted = _mm512_mask_cmpeq_epi32_mask(positive, index, _mm512_set1_epi32(floor.zero));
        index = _mm512_mask_mov_epi32(index, lifted, _mm512_set1_epi32(floor.smallest));
    }
    return index;
}

// quantize16_as for `count` consecutive groups of 16 values, the codes stored as bytes: four groups' indices packed
// into one 64-byte store (two packs and a permute, where a narrowing store per group costs more), the rest one by one.
template <cpu::KeyLookup kLookup, Floor kFloor, Known kKnown>
__attribute__((always_inline)) inline void quantize_groups_as(const cpu::KeyTable& t, const RunRegisters& runs,
                                                             const float* midpoints, const float* x,
                                                             float reciprocal_absmax, uint8_t* codes,
                                                             PositiveFloor floor, int64_t count) {
#define DSBNB_GROUP(j) quantize16_as<kLookup, kFloor, kKnown>(t, runs, midpoints, x + (j), reciprocal_absmax, floor)
    // the packs interleave 128-bit lanes: dword k of the packed vector holds group k % 4's bytes of lane k / 4
    const __m512i in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    int64_t j = 0;
    for (; j + 64 <= 16 * count; j += 64) {
        const __m512i low = _mm512_packs_epi32(DSBNB_GROUP(j), DSBNB_GROUP(j + 16));  // 0..255: no saturation
        const __m512i high = _mm512_packs_epi32(DSBNB_GROUP(j + 32), DSBNB_GROUP(j + 48));
        _mm512_storeu_si512(codes + j, _mm512_permutexvar_epi32(in_order, _mm512_packus_epi16(low, high)));
    }
    for (; j < 16 * count; j += 16) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtepi32_epi8(DSBNB_GROUP(j)));
    }
#undef DSBNB_GROUP
}

template <cpu::KeyLookup kLookup, Known kKnown>
__attribute__((always_inline)) inline void quantize_groups_floored(const cpu::KeyTable& t, const RunRegisters& runs,
                                                                  const float* midpoints, const float* x,
                                                                  float reciprocal_absmax, uint8_t* codes,
                                                                  PositiveFloor floor, Floor kind, int64_t count) {
    if (kind == Floor::kMax) {
        quantize_groups_as<kLookup, Floor::kMax, kKnown>(t, runs, midpoints, x, reciprocal_absmax, codes, floor,
                                                         count);
    } else if (kind == Floor::kLift) {
        quantize_groups_as<kLookup, Floor::kLift, kKnown>(t, runs, midpoints, x, reciprocal_absmax, codes, floor,
                                                          count);
    } else {
        quantize_groups_as<kLookup, Floor::kNone, kKnown>(t, runs, midpoints, x, reciprocal_absmax, codes, floor,
                                                          count);
    }
}

// The codes of `count` groups of 16 values, the lookup, the floor (`kind`, floor_kind of `floor`) and what is `known`
// of the values (see Known) chosen once: by the runs where `lookup` is KeyLookup::kRuns and the map has them, else by
// the key table (gathered, or KeyLookup::kScalar's loads). The key table's paths always test (they are the fallbacks,
// not worth the instances).
__attribute__((always_inline)) inline void quantize_groups(const cpu::KeyTable& t, const RunRegisters& runs,
                                                          const float* midpoints, const float* x,
                                                          float reciprocal_absmax, uint8_t* codes,
                                                          PositiveFloor floor, Floor kind, Known known,
                                                          cpu::KeyLookup lookup, int64_t count) {
#define DSBNB_GROUPS(LOOKUP, KNOWN) \
    quantize_groups_floored<LOOKUP, KNOWN>(t, runs, midpoints, x, reciprocal_absmax, codes, floor, kind, count)
    if (lookup == cpu::KeyLookup::kRuns && runs.usable) {
        if (known == Known::kFiniteNonNegative) {
            DSBNB_GROUPS(cpu::KeyLookup::kRuns, Known::kFiniteNonNegative);
        } else if (known == Known::kFinite) {
            DSBNB_GROUPS(cpu::KeyLookup::kRuns, Known::kFinite);
        } else {
            DSBNB_GROUPS(cpu::KeyLookup::kRuns, Known::kNothing);
        }
    } else if (lookup == cpu::KeyLookup::kScalar) {
        DSBNB_GROUPS(cpu::KeyLookup::kScalar, Known::kNothing);
    } else {
        DSBNB_GROUPS(cpu::KeyLookup::kGather, Known::kNothing);
    }
#undef DSBNB_GROUPS
}

// `count` groups of 16 values, everything chosen at run time (the checks' entry point); `floor` as floor_kind says.
inline void quantize16(const cpu::KeyTable& t, const RunRegisters& runs, const float* midpoints, const float* x,
                             float reciprocal_absmax, uint8_t* codes, PositiveFloor floor, Known known,
                             cpu::KeyLookup lookup, int64_t count) {
    quantize_groups(t, runs, midpoints, x, reciprocal_absmax, codes, floor, floor_kind(floor, midpoints), known,
                    lookup, count);
}

enum class Grad { kFloat32, kBFloat16, kFloat16 };

// VFPCLASSPS's classes of a gradient the update skips (dsbnb's finite-gradient rule): quiet NaN, +inf, -inf,
// signalling NaN. One class test instead of |g| <= the largest float's two operations; the same lanes.
constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;
// VRANGEPS's max(|a|, |b|) with the sign cleared: a block's absmax in one operation instead of an AND and a MAX. What
// it makes of a NaN moment does not matter (on an AMD Zen 5 core: the other operand for a quiet NaN, NaN for a
// signalling one): the update then reports the block NaN, and its caller takes the absmax by the portable first-NaN
// rule instead.
constexpr int kMaxMagnitude = 0x0B;

// 16 gradients as fp32 (bf16 and fp16 widen exactly).
template <Grad kind>
inline __m512 load_grad16(const void* g) {
    if (kind == Grad::kFloat32) return _mm512_loadu_ps(g);
    const __m256i half = _mm256_loadu_si256(static_cast<const __m256i*>(g));
    if (kind == Grad::kFloat16) return _mm512_cvtph_ps(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// The update of one full 256-element block of an 8-bit segment, kept in registers from dequantization to the new
// moments: the same operations, in the same order, as block_8bit's portable loops (dsbnb::adam_moments and
// adam_param; a non-finite gradient keeps the element). Writes p, the new moments m and v (for quantize16), whether
// no v has its sign bit set (`v_signless`: the second moment's quantizer may then leave the sign out, Known), and
// returns false when a moment is NaN (absmax then needs the portable first-NaN rule).
template <Grad kind, bool Scale>
inline bool update_block(const Hyper& h, float* p, const void* grads, const uint8_t* c1, const uint8_t* c2,
                         float scale1, float scale2, const FastTables& t1, const FastTables& t2, float inv_scale,
                         float* m, float* v, float& max1, float& max2, bool& v_signless) {
    const __m512 beta1 = _mm512_set1_ps(h.beta1), beta2 = _mm512_set1_ps(h.beta2);
    const __m512 omb1 = _mm512_set1_ps(h.one_minus_beta1), omb2 = _mm512_set1_ps(h.one_minus_beta2);
    const __m512 eps_hat = _mm512_set1_ps(h.eps_hat), decay = _mm512_set1_ps(h.decay);
    const __m512 step_size = _mm512_set1_ps(h.step_size), inv = _mm512_set1_ps(inv_scale);
    const int grad_bytes = kind == Grad::kFloat32 ? 4 : 2;
    __m512 top1 = _mm512_setzero_ps(), top2 = _mm512_setzero_ps();
    __m512i v_signs = _mm512_setzero_si512();  // the OR of every v's bits: its sign bit, whether any v has one
    __mmask16 nan = 0;
    for (int64_t j = 0; j < kBlock; j += 64) {
        __m512 m_old[4], v_old[4];
        dequantize64(t1, c1 + j, scale1, m_old);
        dequantize64(t2, c2 + j, scale2, v_old);
        for (int k = 0; k < 4; ++k) {
            const int64_t at = j + 16 * k;
            __m512 g = load_grad16<kind>(static_cast<const char*>(grads) + at * grad_bytes);
            if (Scale) g = _mm512_mul_ps(g, inv);
            const __m512 mm = _mm512_add_ps(_mm512_mul_ps(beta1, m_old[k]), _mm512_mul_ps(omb1, g));
            const __m512 vv = _mm512_add_ps(_mm512_mul_ps(beta2, v_old[k]), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
            const __m512 direction = _mm512_div_ps(mm, _mm512_add_ps(_mm512_sqrt_ps(vv), eps_hat));
            const __m512 p_old = _mm512_loadu_ps(p + at);
            const __m512 p_new = _mm512_add_ps(_mm512_mul_ps(p_old, decay), _mm512_mul_ps(step_size, direction));
            const __mmask16 skip = _mm512_fpclass_ps_mask(g, kNonFinite);  // the element keeps its values
            const __m512 m_new = _mm512_mask_mov_ps(mm, skip, m_old[k]), v_new = _mm512_mask_mov_ps(vv, skip, v_old[k]);
            _mm512_storeu_ps(p + at, _mm512_mask_mov_ps(p_new, skip, p_old));
            _mm512_store_ps(m + at, m_new);
            _mm512_store_ps(v + at, v_new);
            top1 = _mm512_range_ps(m_new, top1, kMaxMagnitude);
            top2 = _mm512_range_ps(v_new, top2, kMaxMagnitude);
            v_signs = _mm512_or_si512(v_signs, _mm512_castps_si512(v_new));
            nan |= _mm512_cmp_ps_mask(m_new, v_new, _CMP_UNORD_Q);
        }
    }
    max1 = _mm512_reduce_max_ps(top1);
    max2 = _mm512_reduce_max_ps(top2);
    v_signless = _mm512_reduce_or_epi32(v_signs) >= 0;
    return nan == 0;
}

// The skeleton of a one-state rule's full-block update in registers (Lion, SGD-momentum): dequantize the momentum 64
// codes at a time, and for each 16 elements widen and unscale the gradient, call `step(p_old, m_old, g, p_new,
// m_new)`, keep elements whose gradient is not finite, store p and the new momentum m (for quantize16) and track the
// absmax. Returns false when a momentum is NaN (absmax then needs the portable first-NaN rule).
template <Grad kind, bool Scale, typename Step>
inline bool one_state_update_block(float* p, const void* grads, const uint8_t* c1, float scale1, const FastTables& t1,
                                   float inv_scale, float* m, float& max1, Step step) {
    const __m512 inv = _mm512_set1_ps(inv_scale);
    const int grad_bytes = kind == Grad::kFloat32 ? 4 : 2;
    __m512 top = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t j = 0; j < kBlock; j += 64) {
        __m512 m_old[4];
        dequantize64(t1, c1 + j, scale1, m_old);
        for (int k = 0; k < 4; ++k) {
            const int64_t at = j + 16 * k;
            __m512 g = load_grad16<kind>(static_cast<const char*>(grads) + at * grad_bytes);
            if (Scale) g = _mm512_mul_ps(g, inv);
            const __m512 p_old = _mm512_loadu_ps(p + at);
            const __mmask16 skip = _mm512_fpclass_ps_mask(g, kNonFinite);  // the element keeps its values
            __m512 p_new, mm;
            step(p_old, m_old[k], g, p_new, mm);
            const __m512 m_new = _mm512_mask_mov_ps(mm, skip, m_old[k]);
            _mm512_storeu_ps(p + at, _mm512_mask_mov_ps(p_new, skip, p_old));
            _mm512_store_ps(m + at, m_new);
            top = _mm512_range_ps(m_new, top, kMaxMagnitude);
            nan |= _mm512_cmp_ps_mask(m_new, m_new, _CMP_UNORD_Q);
        }
    }
    max1 = _mm512_reduce_max_ps(top);
    return nan == 0;
}

// The Lion update of one full block: the same operations, in the same order, as lion8bit_cpu.cpp's portable loop
// (dsbnb::lion_param and lion_momentum).
template <Grad kind, bool Scale>
inline bool lion_update_block(const LionHyper& h, float* p, const void* grads, const uint8_t* c1, float scale1,
                              const FastTables& t1, float inv_scale, float* m, float& max1) {
    const __m512 beta1 = _mm512_set1_ps(h.beta1), beta2 = _mm512_set1_ps(h.beta2);
    const __m512 omb1 = _mm512_set1_ps(h.one_minus_beta1), omb2 = _mm512_set1_ps(h.one_minus_beta2);
    const __m512 decay = _mm512_set1_ps(h.decay), zero = _mm512_setzero_ps();
    // lr * lion_sign: lion_sign is 1 - 0, 0 - 1 or 0 - 0 (zero and NaN; +0), so the product is lr, -lr or lr * +0
    // (exactly, NaN aside), chosen per lane by the two compares: two operations fewer per 16 than the sign's masks,
    // its subtraction and the product
    const __m512 lr_up = _mm512_set1_ps(h.lr), lr_down = _mm512_set1_ps(-h.lr);
    const __m512 lr_still = _mm512_set1_ps(h.lr * 0.0f);
    return one_state_update_block<kind, Scale>(
        p, grads, c1, scale1, t1, inv_scale, m, max1,
        [&](__m512 p_old, __m512 m_old, __m512 g, __m512& p_new, __m512& m_new) {
            const __m512 decayed = _mm512_mul_ps(p_old, decay);
            const __m512 direction = _mm512_add_ps(_mm512_mul_ps(beta1, m_old), _mm512_mul_ps(omb1, g));
            const __mmask16 positive = _mm512_cmp_ps_mask(direction, zero, _CMP_GT_OQ);
            const __mmask16 negative = _mm512_cmp_ps_mask(direction, zero, _CMP_LT_OQ);
            const __m512 step = _mm512_mask_mov_ps(_mm512_mask_mov_ps(lr_still, positive, lr_up), negative, lr_down);
            p_new = _mm512_sub_ps(decayed, step);
            m_new = _mm512_add_ps(_mm512_mul_ps(beta2, m_old), _mm512_mul_ps(omb2, g));
        });
}

// The SGD-momentum update of one full block: the same operations, in the same order, as momentum8bit_cpu.cpp's
// portable loop (dsbnb::momentum_state and momentum_param).
template <Grad kind, bool Scale>
inline bool momentum_update_block(const MomentumHyper& h, float* p, const void* grads, const uint8_t* c1,
                                  float scale1, const FastTables& t1, float inv_scale, float* m, float& max1) {
    const __m512 beta1 = _mm512_set1_ps(h.beta1), wd = _mm512_set1_ps(h.weight_decay), lr = _mm512_set1_ps(h.lr);
    const bool decay = h.weight_decay > 0.0f, first = h.first != 0.0f;
    return one_state_update_block<kind, Scale>(
        p, grads, c1, scale1, t1, inv_scale, m, max1,
        [&](__m512 p_old, __m512 m_old, __m512 g, __m512& p_new, __m512& m_new) {
            if (decay) g = _mm512_add_ps(g, _mm512_mul_ps(p_old, wd));  // coupled weight decay
            m_new = first ? g : _mm512_add_ps(_mm512_mul_ps(beta1, m_old), g);
            p_new = _mm512_sub_ps(p_old, _mm512_mul_ps(lr, m_new));
        });
}

}  // namespace avx512
}  // namespace dsbnb

#endif
