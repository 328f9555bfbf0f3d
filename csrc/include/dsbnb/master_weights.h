// dsbnb/master_weights.h — how the fused kernels read and write master weights that are not fp32, shared by the CPU
// (csrc/cpu/fused_cpu.h) and CUDA (csrc/cuda/fused_step.cuh) kernels: bf16 master weights, widened exactly and
// rounded to nearest even after the update (as bitsandbytes rounds a bf16 parameter after its fp32 update), and
// compensated ones, a bf16 weight plus an int8 rounding error (deepspeed_bnb/ops/compensated.py: `join` and `split`,
// bit for bit, which the pure-torch reference uses).
//
// Every kernel widens a block's master weights to fp32 (bf16_value, join), updates them and stores them back
// (bf16_round, split): so one update rule serves the three kinds, and a kind costs the kernel nothing but its loads
// and stores (csrc/cpu/fused_cpu.h: with_fp32_master; csrc/cuda/fused_step.cuh). A NaN stored as bf16 is the quiet NaN
// 0x7FC0 (torch's scalar conversion; its vectorized one writes 0xFFFF: the reference canonicalizes the same way).
// References: torch's c10::BFloat16 round_to_nearest_even; FlashOptim's 24-bit master weights (bf16 + 8 error bits).
// Build: header only, included by the kernels (see csrc/cpu/adam8bit_cpu.cpp and csrc/cuda/adam8bit.cu).
// Test: pytest tests/kernels/test_fused_rules.py -k "master_weights or rounding" (kernel == reference, bit for bit, per
// rule and kind; the reference within one rounding of bnb), tests/kernels/test_master_weights_native.py (error_unit,
// join and split against their frexp/ldexp definition, exhaustively), tests/unit/test_master_weights.py (the engine).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dsbnb/adam8bit.h"

namespace dsbnb {

// What a partition's master weights are (the values of deepspeed_bnb.optim.master_weights' modes). The CUDA kernels
// take a fourth value, kFloat32WithBf16Copy: fp32 master weights whose bf16 copy (the model's weights, the operators'
// lp_params) the kernel writes beside them, each kind its own compiled kernel so that the others keep their registers.
// The CPU kernels write that copy beside any fp32 kind instead (csrc/cpu/fused_cpu.h: ModelCopy).
enum class MasterKind : int { kFloat32 = 0, kBFloat16 = 1, kCompensated = 2, kFloat32WithBf16Copy = 3 };

// Whether a kind's values are fp32 (read and written as floats).
DSBNB_HD constexpr bool fp32_values(MasterKind kind) {
    return kind == MasterKind::kFloat32 || kind == MasterKind::kFloat32WithBf16Copy;
}

// A partition's master weights as raw pointers: fp32 values, or bf16 bits and (compensated) their int8 error terms.
struct Master {
    MasterKind kind;          // which of the kinds
    void* values;             // float* (kFloat32, kFloat32WithBf16Copy) or uint16_t* bf16 bits
    int8_t* error;            // int8 error terms in 1/256 of the bf16 ulp (kCompensated), else null
    uint16_t* copy = nullptr; // kFloat32WithBf16Copy: the bf16 bits of the model's copy of the weights, else null
};

constexpr int kErrorShift = 16;       // compensated.py _STEP_SHIFT: one error step is 2^(E - 16), |hi| = m * 2^E
constexpr int kMinExponent = -125;    // compensated.py _MIN_EXPONENT
constexpr float kMaxErrorSteps = 127.0f;  // compensated.py _MAX_STEPS
constexpr uint16_t kBf16QuietNaN = 0x7FC0;

DSBNB_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

DSBNB_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
#endif
}

DSBNB_HD float bf16_value(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even; NaN becomes the quiet NaN 0x7FC0.
DSBNB_HD uint16_t bf16_round(float x) {
    if (x != x) return kBf16QuietNaN;
    const uint32_t u = float_to_bits(x);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// One error step of a bf16 weight: 2^(E - 16), E its frexp exponent, at least kMinExponent (0 included). Spelled with
// integer operations on the exponent field, not frexpf/ldexpf, which are library calls on the CPU (no vectorization:
// they made a compensated step ~8x an fp32 one there): E is the biased exponent - 126 for normal numbers; zero and
// subnormals (biased exponent 0) fall under kMinExponent; 2^(E - 16) is a normal float down to 2^-126 and a subnormal
// one below (2^-141 at the least). Equal to the frexpf/ldexpf form for every finite bf16 value
// (tests/native/master_weights_check.cpp); for an infinite or NaN weight (whose frexp exponent is unspecified) any
// finite unit gives the same join and split.
DSBNB_HD int error_exponent(float hi) {  // error_unit(hi) is 2^error_exponent(hi), in [-141, 113]
    const int biased = static_cast<int>((float_to_bits(hi) >> 23) & 0xFFu);
    return (biased - 126 < kMinExponent ? kMinExponent : biased - 126) - kErrorShift;
}

DSBNB_HD float error_unit(float hi) {
    const int exponent = error_exponent(hi);
    return exponent >= -126 ? bits_to_float(static_cast<uint32_t>(exponent + 127) << 23)
                            : bits_to_float(1u << (exponent + 149));
}

// x / error_unit(hi) for split, spelled as two exact scalings where the host runs it: error_unit is a power of two,
// 2^-k with k = 16 - E in [-113, 141], so the quotient is x * 2^k; 2^k itself may not be a float (k > 127 for the
// weights below 2^-111), so it is applied as 2^(k >> 1) and then 2^(k - (k >> 1)), each a normal float. Scaling by a
// power of two is exact unless it overflows or drops bits into the subnormals, and neither happens for split's
// x = w - bf16(w): a multiple of w's fp32 ulp (2^(E - 24) or the subnormal quantum) below half a bf16 ulp (2^(E - 8)),
// so every intermediate lies between 2^-8 and 2^8 in magnitude, or is 0, inf or NaN (which stay so). The quotient is
// therefore exactly representable, IEEE division returns it exactly, and the two products give the same bits (every
// float near every bf16 value and 2^24 random ones: tests/native/master_weights_check.cpp). The division cost the CPU
// as much as the whole 8-bit AdamW update per element (one VDIVPS per 8 or 16 elements beside the step's own); the
// CUDA kernels keep the division their GPU runs were proven with.
DSBNB_HD float div_error_unit(float x, float hi) {
#if defined(__CUDA_ARCH__)
    return x / error_unit(hi);
#else
    const int k = -error_exponent(hi);
    const int first = k >> 1;  // floor(k / 2): first in [-57, 70], k - first in [-56, 71]
    return (x * bits_to_float(static_cast<uint32_t>(first + 127) << 23)) *
           bits_to_float(static_cast<uint32_t>(k - first + 127) << 23);
#endif
}

// compensated.join: the fp32 weight of bf16 bits `hi` and error steps `lo`.
DSBNB_HD float join(uint16_t hi, int8_t lo) {
    const float wide = bf16_value(hi);
    return lo == 0 ? wide : wide + static_cast<float>(lo) * error_unit(wide);
}

// compensated.split: bf16 bits and error steps of fp32 `w` (the error rounded half to even, a non-finite one 0,
// clamped to +-127 steps).
DSBNB_HD void split(float w, uint16_t& hi, int8_t& lo) {
    hi = bf16_round(w);
    const float rounded = bf16_value(hi);
    float steps = rintf(div_error_unit(w - rounded, rounded));
    if (!(fabsf(steps) <= 3.40282347e+38f)) steps = 0.0f;
    steps = steps < -kMaxErrorSteps ? -kMaxErrorSteps : (steps > kMaxErrorSteps ? kMaxErrorSteps : steps);
    lo = static_cast<int8_t>(steps);
}

}  // namespace dsbnb
