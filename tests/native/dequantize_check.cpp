// dequantize_check.cpp — holds the AVX-512 dequantizer (csrc/cpu/adam8bit_avx512.h: dequantize64, qmap[code] * scale
// for 64 codes) to the scalar product it replaces, bit for bit, in the spelling the build compiles: byte permutes where
// the compiler targets AVX-512 VBMI, 32-entry float permutes where it targets AVX-512 F, BW and DQ only (Skylake-SP,
// Cascade Lake; gcc's x86-64-v4). Every code at every one of the 64 positions, for scales that give normal, subnormal,
// zero, infinite and NaN products.
// Usage: dequantize_check MAP.bin
// Prints one line "checked N mismatches M spelling S" (S: vbmi, float-permutes, or none where the build has no AVX-512
// path) and the first mismatches; exit code 1 on any mismatch.
// Build: g++ -O2 -march=native -std=c++17 -Icsrc/include -Icsrc/cpu tests/native/dequantize_check.cpp
// (tests/kernels/test_dequantize_spellings.py, also with -march=x86-64-v4 where this CPU runs it; -DEXPECT_WRONG_CODE
// builds its control, which expects the entry of the code with bit 5 flipped and so must report mismatches).
#include <cmath>
#include <cstdio>
#include <limits>

#include "adam8bit_avx512.h"
#include "native_check.h"

int main(int argc, char** argv) {
    float qmap[256];
    if (!native_check::map_argument(argc, argv, 2, "MAP.bin", qmap)) return 2;
#if DSBNB_AVX512
    const dsbnb::avx512::FastTables tables(qmap);
    const float scales[] = {1.0f, 0.3718f, -2.5f, 3.0e-39f, 1.0e38f, 0.0f, std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
    unsigned long long checked = 0, mismatches = 0;
    for (const float scale : scales) {
        for (int offset = 0; offset < 256; ++offset) {  // code (i + offset) % 256 at position i: each at each position
            alignas(64) uint8_t codes[64];
            for (int i = 0; i < 64; ++i) codes[i] = static_cast<uint8_t>(i + offset);
            __m512 out[4];
            dsbnb::avx512::dequantize64(tables, codes, scale, out);
            alignas(64) float got[64];
            for (int k = 0; k < 4; ++k) _mm512_store_ps(got + 16 * k, out[k]);
            for (int i = 0; i < 64; ++i) {
#ifdef EXPECT_WRONG_CODE
                const float want = qmap[codes[i] ^ 32] * scale;
#else
                const float want = qmap[codes[i]] * scale;
#endif
                ++checked;
                if (native_check::bits_of(got[i]) != native_check::bits_of(want)) {
                    if (++mismatches <= 5) {
                        std::printf("mismatch: code %d at %d, scale %g: got %a, want %a\n", codes[i], i, scale,
                                    got[i], want);
                    }
                }
            }
        }
    }
#if DSBNB_AVX512_VBMI
    const char* spelling = "vbmi";
#else
    const char* spelling = "float-permutes";
#endif
    std::printf("checked %llu mismatches %llu spelling %s\n", checked, mismatches, spelling);
    return mismatches ? 1 : 0;
#else
    std::printf("checked 0 mismatches 0 spelling none\n");
    return 0;
#endif
}
