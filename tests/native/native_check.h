// native_check.h — what the host checks in tests/native share: reading a map file (named on the command line), and
// walking the floats around a value, and a float's bits. Header only, included from beside it by
// compact_quantizer_check.cpp, key_table_check.cpp and dequantize_check.cpp.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>

namespace native_check {

inline float float_of(uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
}

inline uint32_t bits_of(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    return bits;
}

// The 256 float32 values of the map file `path` into `code`; false, after a message, when it cannot be read.
inline bool read_map(const char* path, float* code) {
    FILE* f = std::fopen(path, "rb");
    const bool ok = f != nullptr && std::fread(code, sizeof(float), 256, f) == 256;
    if (f != nullptr) std::fclose(f);
    if (!ok) std::fprintf(stderr, "cannot read 256 float32 from %s\n", path);
    return ok;
}

// The map file argv[1] names, into `code`, where the command line holds at least `needed` words; false, after the
// usage line (`usage`: what follows the program's name) or read_map's message, otherwise.
inline bool map_argument(int argc, char** argv, int needed, const char* usage, float* code) {
    if (argc < needed) {
        std::fprintf(stderr, "usage: %s %s\n", argv[0], usage);
        return false;
    }
    return read_map(argv[1], code);
}

// check(bits) for every float whose magnitude is within `ulps` of x's, up to infinity, with either sign.
template <typename Check>
void around(float x, int ulps, Check&& check) {
    const uint32_t b = bits_of(x);
    for (int d = -ulps; d <= ulps; ++d) {
        const int64_t p = static_cast<int64_t>(b & 0x7FFFFFFFu) + d;
        if (p < 0 || p > 0x7F800000LL) continue;
        check(static_cast<uint32_t>(p) | (b & 0x80000000u));
        check(static_cast<uint32_t>(p) ^ 0x80000000u ^ (b & 0x80000000u));  // the other sign too
    }
}

}  // namespace native_check
