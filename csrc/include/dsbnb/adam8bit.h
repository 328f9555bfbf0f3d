// dsbnb/adam8bit.h — the per-element arithmetic and the quantizer of the fused 8-bit AdamW, Lion and SGD-momentum
// steps, shared by the CPU (csrc/cpu/adam8bit_cpu.cpp, lion8bit_cpu.cpp, momentum8bit_cpu.cpp) and CUDA
// (csrc/cuda/adam8bit.cu, lion8bit.cu, momentum8bit.cu) kernels so that
// both evaluate exactly the same sequence of individually rounded fp32 operations; and the segment-table checks their
// bindings share.
//
// Canonical semantics and their reasons: deepspeed_bnb/ops/reference.py (the pure-torch reference these kernels are
// tested against bit for bit). Build requirements that keep them exact: no FMA contraction (gcc -ffp-contract=off,
// nvcc -fmad=false), no fast-math, IEEE sqrt and division (nvcc's defaults -prec-div=true -prec-sqrt=true).
// Free of torch and CUDA runtime headers: included by both translation units.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSBNB_HD __host__ __device__ __forceinline__
#else
#define DSBNB_HD inline
#endif

namespace dsbnb {

constexpr int64_t kBlock = 256;        // bitsandbytes' quantization block (elements)
constexpr int64_t kSegmentFields = 5;  // segment table columns: offset, numel, eight_bit, fp32_offset, hyper_row
constexpr int64_t kHyperFields = 7;    // AdamW hyper table columns, see Hyper
constexpr int64_t kLionHyperFields = 6;  // Lion hyper table columns, see LionHyper
constexpr int64_t kMomentumHyperFields = 4;  // SGD-momentum hyper table columns, see MomentumHyper
constexpr int64_t kBnbHyperFields = 7;  // hyper table columns of the bnb_cuda arithmetic, see BnbRow
constexpr int kLutBits = 16;           // quantizer look-up: sign, 8 exponent and 7 mantissa bits of the value

// One row of the hyper-parameter table: per-step constants, computed in fp64 on the host and rounded once.
struct Hyper {
    float beta1, beta2;              // moment decays
    float one_minus_beta1;           // 1 - beta1
    float one_minus_beta2;           // 1 - beta2
    float eps_hat;                   // eps * sqrt(1 - beta2^t), added to sqrt(v)
    float decay;                     // 1 - lr * weight_decay (decoupled weight decay)
    float step_size;                 // -lr * sqrt(1 - beta2^t) / (1 - beta1^t)
};

// One row of the Lion hyper-parameter table (host-computed as above).
struct LionHyper {
    float beta1, beta2;     // update-direction interpolation, momentum decay
    float one_minus_beta1;  // 1 - beta1
    float one_minus_beta2;  // 1 - beta2
    float decay;            // 1 - lr * weight_decay (decoupled weight decay, applied before the update)
    float lr;               // the step: lr * sign(direction)
};
// One row of the SGD-with-momentum hyper-parameter table (bnb's "momentum" rule).
struct MomentumHyper {
    float beta1;         // momentum
    float weight_decay;  // coupled: g + p * weight_decay, only when > 0
    float lr;            // p - lr * m
    float first;         // nonzero at step 1: m = g (the stored momentum is ignored)
};
// One row of the hyper table in the bnb_cuda arithmetic (csrc/include/dsbnb/bnb_cuda_math.h), every rule alike:
// bnb's own kernel arguments, rounded to fp32 as its ctypes.c_float arguments are; the step as an fp32 (what bnb's
// kernels convert it to). A rule ignores what it does not read (Lion: eps and step; SGD-momentum: beta2 and eps).
struct BnbRow {
    float beta1, beta2, eps, weight_decay, lr, step, gnorm_scale;
};
static_assert(sizeof(BnbRow) == kBnbHyperFields * sizeof(float), "BnbRow mirrors a float32 [H, 7] row");
static_assert(sizeof(Hyper) == kHyperFields * sizeof(float), "Hyper mirrors a float32 [H, 7] row");
static_assert(sizeof(LionHyper) == kLionHyperFields * sizeof(float), "LionHyper mirrors a float32 [H, 6] row");
static_assert(sizeof(MomentumHyper) == kMomentumHyperFields * sizeof(float),
              "MomentumHyper mirrors a float32 [H, 4] row");

// One row of the segment table: the part of one parameter that this partition owns.
struct Segment {
    int64_t offset;       // first element in the partition (a multiple of kBlock)
    int64_t numel;        // elements
    int64_t eight_bit;    // 1: uint8 codes + per-block absmax; 0: fp32 state
    int64_t fp32_offset;  // first element in the packed fp32 state (fp32 segments only)
    int64_t hyper_row;    // row of the hyper table
};
static_assert(sizeof(Segment) == kSegmentFields * sizeof(int64_t), "Segment mirrors an int64 [S, 5] row");

DSBNB_HD void adam_moments(float m_old, float v_old, float g, const Hyper& h, float& m, float& v) {
    const float t1 = h.beta1 * m_old;
    const float t2 = h.one_minus_beta1 * g;
    m = t1 + t2;
    const float gg = g * g;
    const float t3 = h.beta2 * v_old;
    const float t4 = h.one_minus_beta2 * gg;
    v = t3 + t4;
}

DSBNB_HD float adam_param(float p, float m, float v, const Hyper& h) {
    const float root = sqrtf(v);
    const float denominator = root + h.eps_hat;
    const float direction = m / denominator;
    const float decayed = p * h.decay;
    const float step = h.step_size * direction;
    return decayed + step;
}

// bnb's `sgn` of the Lion direction: +1, -1, and +0 for a zero or NaN argument (so that p - lr * sign leaves p).
DSBNB_HD float lion_sign(float c) { return static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f); }

// Lion's new parameter: the decoupled decay first, then the signed step along beta1 * m_old + (1 - beta1) * g.
DSBNB_HD float lion_param(float p, float m_old, float g, const LionHyper& h) {
    const float decayed = p * h.decay;
    const float t1 = h.beta1 * m_old;
    const float t2 = h.one_minus_beta1 * g;
    const float direction = t1 + t2;
    const float step = h.lr * lion_sign(direction);
    return decayed - step;
}

// Lion's new momentum (after the parameter update, from the old momentum).
DSBNB_HD float lion_momentum(float m_old, float g, const LionHyper& h) {
    const float t3 = h.beta2 * m_old;
    const float t4 = h.one_minus_beta2 * g;
    return t3 + t4;
}

// SGD-momentum's new momentum: coupled weight decay into the gradient, then m = g' at step 1, else beta1 * m_old + g'.
DSBNB_HD float momentum_state(float p, float m_old, float g, const MomentumHyper& h) {
    float gw = g;
    if (h.weight_decay > 0.0f) {
        const float decay = p * h.weight_decay;
        gw = g + decay;
    }
    if (h.first != 0.0f) return gw;
    const float t1 = h.beta1 * m_old;
    return t1 + gw;
}

// SGD-momentum's new parameter, from the new momentum.
DSBNB_HD float momentum_param(float p, float m, const MomentumHyper& h) {
    const float step = h.lr * m;
    return p - step;
}

// 1 / absmax of a block, or 0 when absmax is not positive (an all-zero block, or NaN).
DSBNB_HD float reciprocal(float absmax) { return absmax > 0.0f ? 1.0f / absmax : 0.0f; }

// x * (1 / absmax), with the reference's conventions for the non-finite cases: inf * 0 counts as the sign of x, a NaN
// x as 0.
DSBNB_HD float normalize(float x, float reciprocal_absmax) {
    const float u = x * reciprocal_absmax;
    return (u != u) ? ((x != x) ? 0.0f : copysignf(1.0f, x)) : u;
}

// The look-up key of a normalized value: its top kLutBits bits (sign, exponent, leading mantissa bits).
DSBNB_HD uint32_t lut_key(float u) {
    uint32_t bits;
    memcpy(&bits, &u, sizeof(bits));
    return bits >> (32 - kLutBits);
}

// The sorted index of the map value nearest to u: the count of fp32 midpoints strictly below u (a value exactly on a
// midpoint takes the lower entry). `lut[lut_key(u)]` is the count below the smallest value sharing those bits; at
// most `max_walk` midpoints lie inside one such bucket (1 for bnb's maps), so that many compares finish it.
// midpoints[255] is +inf, a sentinel that stops the walk.
DSBNB_HD int nearest_sorted(float u, const float* midpoints, const int32_t* lut, int max_walk) {
    int i = lut[lut_key(u)];
    for (int k = 0; k < max_walk; ++k) i += midpoints[i] < u ? 1 : 0;
    return i;
}

// Where a map holds 0 and positive values: the code of 0 and the code of the smallest positive value. Adam's second
// moment is stored with this floor (floor_positive): a positive v whose nearest code is 0's keeps the smallest
// positive code instead, since a v stored as 0 under a nonzero m makes the next step divide by about eps (see
// deepspeed_bnb/ops/reference.py). -1: the map has no such pair, and no floor applies.
struct PositiveFloor {
    int32_t zero = -1;      // code whose value is 0.0
    int32_t smallest = -1;  // code of the smallest positive value
};

DSBNB_HD uint8_t floor_positive(uint8_t code, float x, PositiveFloor f) {
    return (static_cast<int32_t>(code) == f.zero && x > 0.0f) ? static_cast<uint8_t>(f.smallest) : code;
}

// The sizes of one optimizer state's arrays, for the segment checks: its codes and absmax (8-bit segments) and its
// packed fp32 array (fp32 segments).
struct StateSizes {
    int64_t codes, absmax, fp32;
};

// Why segment row `s` cannot be walked, or nullptr: it must lie inside the partition on a block boundary, name a row
// of the hyper table, and fit every state's arrays (8-bit: codes of the partition's size and absmax covering its
// blocks; fp32: its slice of the packed array). Shared by the CPU and CUDA bindings.
inline const char* segment_problem(const Segment& s, int64_t partition, int64_t hyper_rows, const StateSizes* states,
                                   int num_states) {
    if (!(s.offset >= 0 && s.numel > 0 && s.offset + s.numel <= partition && s.offset % kBlock == 0)) {
        return "offset/numel outside the partition or not block-aligned";
    }
    if (!(s.hyper_row >= 0 && s.hyper_row < hyper_rows)) return "hyper_row outside the hyper table";
    for (int k = 0; k < num_states; ++k) {
        if (s.eight_bit && states[k].codes != partition) return "8-bit segments need codes of the partition's size";
        if (s.eight_bit && states[k].absmax * kBlock < s.offset + s.numel) return "absmax too short";
        if (!s.eight_bit && !(s.fp32_offset >= 0 && s.fp32_offset + s.numel <= states[k].fp32)) {
            return "fp32_offset/numel outside the fp32 state";
        }
    }
    return nullptr;
}

// The count of the 255 sorted midpoints below u (strictly): the sorted index of u's nearest map value, by the rule
// every quantizer here stands for. Host-side; the tables below are built with it.
inline int count_below(const float* midpoints, float u) {
    return static_cast<int>(std::lower_bound(midpoints, midpoints + 255, u) - midpoints);
}

// Host-side tables of one 256-entry map: midpoints between sorted values, the code of each sorted value, and the
// look-up used by nearest_sorted. Built once per map (the maps are constants of the optimizer state). int32 entries
// so that CPU vector gathers can read them.
struct QuantTables {
    float midpoints[256];        // (sorted[i] + sorted[i + 1]) / 2 in fp32; [255] = +inf
    int32_t order[256];          // order[sorted index] = code (index into the map)
    int32_t lut[1 << kLutBits];  // count of midpoints below the smallest value with these top bits
    int max_walk;                // most midpoints inside one look-up bucket (the compares nearest_sorted needs)
    // When max_walk <= 1 (bnb's maps), each bucket resolves with one compare: code = u > split ? high : low.
    float split[1 << kLutBits];      // the midpoint inside the bucket (+inf when there is none)
    int32_t codes[1 << kLutBits];    // code of the lower candidate | code of the upper candidate << 8
    PositiveFloor floor;             // the codes floor_positive uses (Adam's second moment)

    explicit QuantTables(const float* qmap) {
        int index[256];
        for (int i = 0; i < 256; ++i) index[i] = i;
        std::stable_sort(index, index + 256, [qmap](int a, int b) { return qmap[a] < qmap[b]; });
        for (int i = 0; i < 256; ++i) order[i] = index[i];
        for (int i = 0; i < 255; ++i) midpoints[i] = (qmap[index[i]] + qmap[index[i + 1]]) / 2.0f;
        midpoints[255] = INFINITY;
        for (int i = 0; i + 1 < 256; ++i) {
            if (qmap[index[i]] == 0.0f && qmap[index[i + 1]] > 0.0f) {
                floor.zero = index[i];
                floor.smallest = index[i + 1];
            }
        }
        max_walk = 0;
        for (uint32_t key = 0; key < (1u << kLutBits); ++key) {
            const bool negative = key >> (kLutBits - 1);
            const uint32_t low_bits = (key << (32 - kLutBits)) | (negative ? (0xFFFFFFFFu >> kLutBits) : 0u);
            const uint32_t high_bits = (key << (32 - kLutBits)) | (negative ? 0u : (0xFFFFFFFFu >> kLutBits));
            float lowest, highest;
            memcpy(&lowest, &low_bits, sizeof(lowest));
            memcpy(&highest, &high_bits, sizeof(highest));
            if (lowest != lowest || highest != highest) {  // NaN keys: never looked up (normalize() removes NaN)
                lut[key] = 0;
                split[key] = INFINITY;
                codes[key] = order[0] | (order[0] << 8);
                continue;
            }
            const int below = count_below(midpoints, lowest);
            const int below_top = count_below(midpoints, highest);
            lut[key] = below;
            max_walk = std::max(max_walk, below_top - below);
            split[key] = below_top > below ? midpoints[below] : INFINITY;
            codes[key] = order[below] | (order[std::min(below + 1, 255)] << 8);
        }
    }
};

}  // namespace dsbnb
