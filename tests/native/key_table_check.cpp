// key_table_check.cpp — holds the CPU kernels' quantizers (csrc/cpu/quantize_keys.h: KeyTable, one look-up of the
// value's top 16 ordered bits and one integer compare; RunTable, a line per run of evenly spaced midpoints) to the
// literal search they replace: the count of fp32 midpoints strictly below u (the project's IEEE rule,
// ops/reference.py), on the host, through each spelling the build has: KeyTable::lookup (portable), lookup8 (AVX2)
// and avx512::quantize16 (AVX-512 F, BW and DQ) by the runs and by the key table's gather, a value near its bucket's
// midpoint settled by the one exact compare the kernels make; quantize16 also with Adam's floor (floor_positive), with
// normalize()'s test skipped and with the sign left out (on the values' magnitudes), in groups of 64 (its packed
// store).
// Usage: key_table_check MAP.bin [near|all]
//   MAP.bin: the map's 256 float32 values; near (default): every float within 256 ulps of a midpoint or a map value,
//   4 ulps of every bucket edge, special values (signed zeros, subnormals, 1, 2, the largest float, infinities) and
//   2^24 random bit patterns; all: every one of the 2^32 floats. NaN is never looked up (the kernels normalize it
//   to 0 first).
// Prints one line "checked N mismatches M usable U runs R paths P" (U: the key table usable; R: the runs usable; P: how
// many spellings ran) and the first mismatches; exit code 1 on any mismatch.
// Build: g++ -O2 -march=native -std=c++17 -Icsrc/include -Icsrc/cpu tests/native/key_table_check.cpp
// (tests/kernels/test_key_table.py; -DKEY_TABLE_MUTANT builds its control, which settles near values the wrong way;
// -DRUN_TABLE_MUTANT the runs' control, which settles none of them: band 0; -DRUN_ENDS_MUTANT the runs' ends'
// control, every line evaluated past its run's last count: top +inf; -DFLOOR_MUTANT the floor's control, which
// expects codes without it; -DSIGNLESS_MUTANT the sign's control, the spelling without it given negative values).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "adam8bit_avx512.h"
#include "native_check.h"
#include "quantize_keys.h"

namespace {

using native_check::bits_of;
using native_check::float_of;

struct Checker {
    const dsbnb::QuantTables& generic;
    const dsbnb::cpu::KeyTable& keys;
    const dsbnb::cpu::RunTable& runs;
    uint64_t checked = 0, mismatches = 0;
    std::vector<float> pending;  // values batched for the vector spellings

    int settle(int index, bool near, float u) const {
#ifdef KEY_TABLE_MUTANT  // a control: ties go up instead of down
        return near ? index + (generic.midpoints[index] <= u ? 1 : 0) : index;
#else
        return near ? index + (generic.midpoints[index] < u ? 1 : 0) : index;
#endif
    }

    int want(float u) const {
        return static_cast<int>(std::lower_bound(generic.midpoints, generic.midpoints + 255, u) - generic.midpoints);
    }

    // The code the kernels store for u with the map's floor applied (floor_positive, x = u here).
    int want_floored(float u) const {
        const int index = want(u);
#ifdef FLOOR_MUTANT  // a control: the floor expected nowhere
        return index;
#endif
        return generic.floor.zero >= 0 && index == generic.floor.zero && u > 0.0f ? generic.floor.smallest : index;
    }

    void report(const char* path, float u, int got, int expected) {
        if (++mismatches <= 10) {
            std::printf("mismatch (%s) at 0x%08x (%.9g): %d, the count of midpoints below is %d\n", path, bits_of(u),
                        u, got, expected);
        }
    }

    void check(uint32_t pattern) {
        const float u = float_of(pattern);
        if (u != u) return;
        ++checked;
        bool near = false;
        const int index = keys.lookup(u, near);
        const int got = settle(index, near, u);
        if (got != want(u)) report("lookup", u, got, want(u));
        pending.push_back(u);
        if (pending.size() == kBatch) flush();
    }

    static constexpr size_t kBatch = 64;  // four groups of 16: the AVX-512 quantizer's packed store

    void flush() {
        while (pending.size() < kBatch) pending.push_back(0.0f);
#if defined(__AVX2__)
        for (size_t eighth = 0; eighth < kBatch / 8; ++eighth) {
            uint8_t out[8];
            const int near = keys.lookup8(_mm256_loadu_ps(pending.data() + 8 * eighth), out);
            for (int k = 0; k < 8; ++k) {
                const float u = pending[8 * eighth + k];
                const int got = settle(out[k], near >> k & 1, u);
                if (got != want(u)) report("lookup8", u, got, want(u));
            }
        }
#endif
#if DSBNB_AVX512
        using dsbnb::cpu::KeyLookup;
        using dsbnb::avx512::Known;
        // the runs with normalize()'s test skipped (no u is NaN here) and the map's floor, the same without the sign
        // (on the values' magnitudes: the sign bit of each cleared), the runs with both, the key table's gather with
        // the floor
        struct Spelling {
            const char* name;
            KeyLookup lookup;
            Known known;
            bool floored;
        };
        float magnitudes[kBatch];
        for (size_t k = 0; k < kBatch; ++k) magnitudes[k] = std::fabs(pending[k]);
        for (const Spelling& s :
             {Spelling{"quantize16 runs, finite, floored", KeyLookup::kRuns, Known::kFinite, true},
              Spelling{"quantize16 runs, finite, non-negative, floored", KeyLookup::kRuns, Known::kFiniteNonNegative,
                       true},
              Spelling{"quantize16 runs", KeyLookup::kRuns, Known::kNothing, false},
              Spelling{"quantize16 gather, floored", KeyLookup::kGather, Known::kNothing, true}}) {
            if (s.lookup == KeyLookup::kRuns && !runs.usable) continue;
#ifdef SIGNLESS_MUTANT  // a control: the spelling without the sign given values with it
            const float* values = pending.data();
#else
            const float* values = s.known == Known::kFiniteNonNegative ? magnitudes : pending.data();
#endif
            uint8_t codes[kBatch];
            dsbnb::avx512::quantize16(keys, dsbnb::avx512::RunRegisters(runs), generic.midpoints, values, 1.0f, codes,
                                      s.floored ? generic.floor : dsbnb::PositiveFloor(), s.known, s.lookup,
                                      kBatch / 16);
            for (size_t k = 0; k < kBatch; ++k) {
                // quantize16 settles near values itself (its exact compare); x * 1.0f is x for every non-NaN float
                const float u = values[k];
#ifdef KEY_TABLE_MUTANT
                const int got = codes[k] + (generic.midpoints[codes[k]] == u ? 1 : 0);
#else
                const int got = codes[k];
#endif
                const int expected = s.floored ? want_floored(u) : want(u);
                if (got != expected) report(s.name, u, got, expected);
            }
        }
#endif
        pending.clear();
    }

};

int paths() {
    int n = 1;
#if defined(__AVX2__)
    ++n;
#endif
#if DSBNB_AVX512
    n += 4;  // quantize16 by the runs (where the map has them; normalize()'s test skipped or made; the sign left out on
             // magnitudes) and by the key table
#endif
    return n;
}

}  // namespace

int main(int argc, char** argv) {
    float code[256];
    if (!native_check::map_argument(argc, argv, 2, "MAP.bin [near|all]", code)) return 2;
    const bool all = argc > 2 && std::string(argv[2]) == "all";
    auto generic = std::make_unique<dsbnb::QuantTables>(code);
    auto keys = std::make_unique<dsbnb::cpu::KeyTable>(*generic);
    auto runs = std::make_unique<dsbnb::cpu::RunTable>(generic->midpoints);
#ifdef RUN_TABLE_MUTANT
    runs->band = 0.0f;  // the control: no value is left to the key table
#endif
#ifdef RUN_ENDS_MUTANT
    for (float& top : runs->top) top = INFINITY;  // the control: every line evaluated past its run's last count
#endif
    Checker c{*generic, *keys, *runs};
    const auto visit = [&c](uint32_t pattern) { c.check(pattern); };
    if (keys->usable) {
        if (all) {
            for (uint64_t p = 0; p <= 0xFFFFFFFFull; ++p) c.check(static_cast<uint32_t>(p));
        } else {
            for (int i = 0; i < 255; ++i) native_check::around(generic->midpoints[i], 256, visit);
            for (int i = 0; i < 256; ++i) native_check::around(code[i], 256, visit);
            for (uint32_t key = 0; key < (1u << 16); ++key) {  // every bucket's edges, as ordered integers
                native_check::around(dsbnb::cpu::KeyTable::from_ordered(static_cast<int32_t>(key << 16)), 4, visit);
            }
            for (float x : {0.0f, -0.0f, 1e-45f, 1.17549435e-38f, 1.0f, 2.0f, 3.4028235e38f, INFINITY}) {
                native_check::around(x, 300, visit);
            }
            std::mt19937 rng(12345);
            for (int i = 0; i < (1 << 24); ++i) c.check(rng());
        }
        c.flush();
    }
    std::printf("checked %llu mismatches %llu usable %d runs %d paths %d\n", static_cast<unsigned long long>(c.checked),
                static_cast<unsigned long long>(c.mismatches), keys->usable ? 1 : 0, runs->usable ? 1 : 0, paths());
    return c.mismatches ? 1 : 0;
}
