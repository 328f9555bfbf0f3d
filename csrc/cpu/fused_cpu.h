// fused_cpu.h — what the CPU kernels of the fused 8-bit optimizer steps share (adam8bit_cpu.cpp for AdamW,
// lion8bit_cpu.cpp for Lion, momentum8bit_cpu.cpp for SGD with momentum): the quantizer tables of a map (built once per
// map), per-block helpers (dequantize, gradient widening, absmax with the reference's NaN rule, requantization to the
// nearest code), argument and segment-table checks, the parallel walk over a partition's 256-element blocks (ATen's
// thread pool), and the dispatch on the gradient dtype and the unscale factor.
//
// Semantics: deepspeed_bnb/ops/reference.py, bit for bit; the arithmetic lives in csrc/include/dsbnb/adam8bit.h.
// Build and test: as the kernels that include it (see adam8bit_cpu.cpp); -ffp-contract=off, no -ffast-math.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "adam8bit_avx512.h"
#include "bnb_cpu32.h"
#include "master_weights_avx2.h"
#include "master_weights_avx512.h"
#include "dsbnb/adam8bit.h"
#include "dsbnb/master_weights.h"
#include "quantize_keys.h"

namespace dsbnb {
namespace cpu {

// Everything the kernels derive from one 256-entry map.
struct MapTables {
    QuantTables generic;  // the exact quantizer of any map (and the settling of near ties)
    KeyTable keys;        // the compact quantizer of bnb-style maps (used where keys.usable)
#if DSBNB_AVX512
    RunTable runs;            // the AVX-512 quantizer of maps made of evenly spaced runs (used where runs.usable)
    avx512::FastTables fast;  // the byte planes of the AVX-512 dequantizer
    avx512::Floor floor_kind;  // how the AVX-512 quantizer applies generic.floor
    explicit MapTables(const float* qmap)
        : generic(qmap), keys(generic), runs(generic.midpoints), fast(qmap),
          floor_kind(avx512::floor_kind(generic.floor, generic.midpoints)) {}
    bool fast_usable() const { return keys.usable; }
#else
    explicit MapTables(const float* qmap) : generic(qmap), keys(generic) {}
    bool fast_usable() const { return false; }
#endif
};

// The maps are optimizer constants: build their tables once per distinct content (one cache for every operator).
inline const MapTables& tables_for(const at::Tensor& qmap) {
    static std::mutex lock;
    static std::vector<std::pair<std::array<float, 256>, std::unique_ptr<MapTables>>> cache;
    std::array<float, 256> key;
    std::memcpy(key.data(), qmap.data_ptr<float>(), sizeof(float) * 256);
    std::lock_guard<std::mutex> guard(lock);
    for (const auto& entry : cache) {
        if (std::memcmp(entry.first.data(), key.data(), sizeof(float) * 256) == 0) return *entry.second;
    }
    cache.emplace_back(key, std::make_unique<MapTables>(key.data()));
    return *cache.back().second;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// A partition's blocks as one range of work items: segment i's blocks are items first[i] to first[i + 1] - 1 (none
// for a segment left out). Built in O(segments): a list of the blocks themselves, as before, took O(blocks), built
// serially and allocated on every call (a million 16-byte entries for a 256M-element partition), before any thread
// could start.
struct BlockPlan {
    std::vector<int64_t> first;  // one entry per segment and one more: the blocks of the segments before it

    int64_t blocks() const { return first.back(); }
};

// The plan of the segments `keep(segment)` accepts (the table checked already).
template <typename Keep>
inline BlockPlan count_blocks(const Segment* table, int64_t count, Keep&& keep) {
    BlockPlan plan;
    plan.first.reserve(static_cast<size_t>(count) + 1);
    plan.first.push_back(0);
    for (int64_t i = 0; i < count; ++i) {
        plan.first.push_back(plan.first.back() + (keep(table[i]) ? (table[i].numel + kBlock - 1) / kBlock : 0));
    }
    return plan;
}

// ok ? a : b, spelled so that gcc keeps an unconditional store: `p[j] = ok ? pn : p[j]` lets it turn the loop into
// VMASKMOVPS masked loads and stores, which are microcoded and slow on AMD Zen (measured: the Lion step ran ~2x
// slower).
inline float select(bool ok, float a, float b) {
    uint32_t ia, ib;
    std::memcpy(&ia, &a, sizeof(ia));
    std::memcpy(&ib, &b, sizeof(ib));
    const uint32_t mask = 0u - static_cast<uint32_t>(ok);
    const uint32_t bits = (ia & mask) | (ib & ~mask);
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

inline bool finite(float x) { return std::fabs(x) <= 3.40282347e+38f; }  // false for inf and NaN; vectorizes

// out[j] = qmap[codes[j]] * scale: one state's old values (a gather per element; the AVX-512 path avoids it).
inline void dequantize_block(int64_t len, const uint8_t* __restrict__ codes, float scale,
                             const float* __restrict__ qmap, float* __restrict__ out) {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) out[j] = qmap[codes[j]] * scale;
}

// out[j] = grad[j] as fp32 (bf16 and fp16 widen exactly), times the unscale factor when Scale.
template <typename GradT, bool Scale>
inline void widen_grads(int64_t len, const GradT* __restrict__ grads, float inv_scale, float* __restrict__ out) {
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) out[j] = Scale ? to_float(grads[j]) * inv_scale : to_float(grads[j]);
}

// max |x| over one block; a NaN element makes it the first NaN, as torch.amax returns it.
inline float block_absmax(int64_t len, const float* x) {
    float top = 0.0f;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (int64_t j = 0; j < len; ++j) {
        const float a = std::fabs(x[j]);
        top = a > top ? a : top;
        nan |= a != a;
    }
    if (nan) {  // rare
        for (int64_t j = 0; j < len; ++j) {
            if (x[j] != x[j]) return std::fabs(x[j]);
        }
    }
    return top;
}

// codes[j] = the nearest code of normalize(x[j], reciprocal_absmax): the portable quantizer (vectorized by the
// compiler). bnb-style maps take the compact key table (one L1 look-up per value; the ~1/256 near ties settled
// exactly after), any other map the generic look-up and its walk.
inline void quantize_block(int64_t len, const float* x, float reciprocal_absmax, uint8_t* __restrict__ codes,
                           const MapTables& tables) {
    const QuantTables& t = tables.generic;
    if (tables.keys.usable) {
        const KeyTable& keys = tables.keys;
        // a value within 256 ulps of its bucket's midpoint (~1 in 256: most blocks hold one) takes the exact compare
        auto settle = [&t](float u) { return static_cast<uint8_t>(nearest_sorted(u, t.midpoints, t.lut, t.max_walk)); };
        int64_t done = 0;
#if defined(__AVX2__)
        const __m256 r = _mm256_set1_ps(reciprocal_absmax);
        const bool scalar = key_lookup().load(std::memory_order_relaxed) == KeyLookup::kScalar;
        for (; done + 8 <= len; done += 8) {
            __m256 u = _mm256_mul_ps(_mm256_loadu_ps(x + done), r);
            if (_mm256_movemask_ps(_mm256_cmp_ps(u, u, _CMP_UNORD_Q))) {  // rare: normalize()'s inf * 0 and NaN rules
                alignas(32) float exact[8];
                for (int k = 0; k < 8; ++k) exact[k] = normalize(x[done + k], reciprocal_absmax);
                u = _mm256_load_ps(exact);
            }
            const int near = keys.lookup8(u, codes + done, scalar);
            if (near) {  // only the flagged lanes, here: no second pass over the block
                alignas(32) float value[8];
                _mm256_store_ps(value, u);
                for (int k = 0; k < 8; ++k) {
                    if (near >> k & 1) codes[done + k] = settle(value[k]);
                }
            }
        }
#endif
        alignas(64) uint8_t flagged[kBlock];  // the near values of the vectorized loop below, settled after it
        int ties = 0;
#pragma omp simd reduction(| : ties)
        for (int64_t j = done; j < len; ++j) {
            bool near;
            codes[j] = static_cast<uint8_t>(keys.lookup(normalize(x[j], reciprocal_absmax), near));
            flagged[j] = near;
            ties |= near;
        }
        if (ties) {  // most blocks hold one: settle only the flagged values, not a second look-up of every value
            for (int64_t j = done; j < len; ++j) {
                if (flagged[j]) codes[j] = settle(normalize(x[j], reciprocal_absmax));
            }
        }
        return;
    }
    if (t.max_walk <= 1) {  // one compare per value
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
            const float u = normalize(x[j], reciprocal_absmax);
            const uint32_t key = lut_key(u);
            const int32_t pair = t.codes[key];
            codes[j] = static_cast<uint8_t>(t.split[key] < u ? pair >> 8 : pair & 0xFF);
        }
        return;
    }
    alignas(64) int32_t index[kBlock];
    alignas(64) float u[kBlock];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        u[j] = normalize(x[j], reciprocal_absmax);
        index[j] = t.lut[lut_key(u[j])];
    }
    for (int k = 0; k < t.max_walk; ++k) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) index[j] += t.midpoints[index[j]] < u[j] ? 1 : 0;
    }
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) codes[j] = static_cast<uint8_t>(t.order[index[j]]);
}

// codes[j] = floor_positive(codes[j], x[j]) over one block (Adam's second moment, after quantize_*).
inline void floor_positive_block(int64_t len, const float* __restrict__ x, uint8_t* __restrict__ codes,
                                 PositiveFloor floor) {
    if (floor.zero < 0) return;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) codes[j] = floor_positive(codes[j], x[j], floor);
}

#if DSBNB_AVX512
template <typename GradT>
constexpr avx512::Grad grad_kind() {
    return std::is_same<GradT, float>::value            ? avx512::Grad::kFloat32
           : std::is_same<GradT, c10::BFloat16>::value ? avx512::Grad::kBFloat16
                                                        : avx512::Grad::kFloat16;
}

// quantize_block for a full block of a map with usable fast tables (same codes; by the runs, or one gather per 16
// values), followed by floor_positive_block where `floored` (Adam's second moment: the map's floor, applied in the
// same pass). `absmax`: the block's (block_absmax); `nan_free`: no x is NaN; `signless`: no x has its sign bit set.
// Then with a finite absmax and reciprocal every x * reciprocal(absmax) is a number, and the quantizer skips
// normalize()'s test; with a positive reciprocal and signless values, none of them is below +0 either, and the
// quantizer leaves the sign out (avx512::Known).
__attribute__((always_inline)) inline void quantize_full_block(const MapTables& t, const float* x, float absmax,
                                                               bool nan_free, uint8_t* codes, bool floored = false,
                                                               bool signless = false) {
    const float r = reciprocal(absmax);
    const avx512::RunRegisters runs(t.runs);
    avx512::Known known = avx512::Known::kNothing;
    if (nan_free && std::isfinite(absmax) && std::isfinite(r)) {
        known = signless && r > 0.0f ? avx512::Known::kFiniteNonNegative : avx512::Known::kFinite;
    }
    avx512::quantize_groups(t.keys, runs, t.generic.midpoints, x, r, codes, t.generic.floor,
                            floored ? t.floor_kind : avx512::Floor::kNone, known,
                            key_lookup().load(std::memory_order_relaxed), kBlock / 16);
}
#endif

// Argument checks whose messages name the operator.
class Checker {
   public:
    explicit Checker(const char* op) : op_(op) {}
    void operator()(bool ok, const std::string& message) const {
        TORCH_CHECK(ok, "deepspeed_bnb::", op_, ": ", message);
    }
    void expect(const at::Tensor& t, const char* name, at::ScalarType dtype) const {
        (*this)(t.device().is_cpu(), std::string(name) + " must be a CPU tensor here (got " + t.device().str() + ")");
        (*this)(t.scalar_type() == dtype,
                std::string(name) + " must be " + c10::toString(dtype) + ", got " + c10::toString(t.scalar_type()));
        (*this)(t.is_contiguous(), std::string(name) + " must be contiguous");
    }

   private:
    const char* op_;
};

// DeepSpeed's unscale/clip factor: 1 when the operator gets none, else the value of its one-element float32 tensor
// (read here on the host: a CPU tensor, so reading it waits for nothing).
inline double scale_of(const Checker& check, const std::optional<at::Tensor>& inv_scale) {
    if (!inv_scale.has_value()) return 1.0;
    check.expect(*inv_scale, "inv_scale", at::kFloat);
    check(inv_scale->numel() == 1, "inv_scale must hold one element");
    return static_cast<double>(inv_scale->item<float>());
}

// Whether a CPU kernel computes the 'bnb_cpu' arithmetic (fp32 segments as bnb's own 32-bit CPU update: bnb_cpu32.h;
// 8-bit segments as 'ieee') rather than 'ieee' (deepspeed_bnb/ops/reference.py throughout); bnb's CUDA arithmetic
// rests on the GPU's approximate reciprocal and square root, which no CPU computes.
inline bool bnb_cpu_arithmetic(const Checker& check, c10::string_view arithmetic) {
    check(arithmetic == "ieee" || arithmetic == "bnb_cpu",
          "the CPU kernels compute the 'ieee' and 'bnb_cpu' arithmetics, got '" +
              std::string(arithmetic.data(), arithmetic.size()) + "'");
    return arithmetic == "bnb_cpu";
}

// KeyLookup from the environment (quantize_keys.h): DEEPSPEED_BNB_CPU_KEY_LOOKUP unset, "runs", "gather" or
// "scalar"; read at every operator call, before its threads start.
inline void choose_key_lookup(const Checker& check) {
    const char* set = std::getenv("DEEPSPEED_BNB_CPU_KEY_LOOKUP");
    const std::string value = set == nullptr ? "" : set;
    check(value.empty() || value == "runs" || value == "gather" || value == "scalar",
          "DEEPSPEED_BNB_CPU_KEY_LOOKUP='" + value +
              "' must be 'runs' (the default), 'gather' or 'scalar': how the CPU kernels find the quantizer's codes "
              "(unset it for the default)");
    key_lookup().store(value == "scalar"   ? KeyLookup::kScalar
                       : value == "gather" ? KeyLookup::kGather
                                           : KeyLookup::kRuns,
                       std::memory_order_relaxed);
}

// Checks the segment and hyper tables against the partition and the states' arrays, and plans every block of every
// segment: the work items of for_each_block.
inline BlockPlan plan_blocks(const Checker& check, const at::Tensor& segments, const at::Tensor& hyper,
                             int64_t hyper_fields, int64_t partition, const StateSizes* states, int num_states) {
    check.expect(segments, "segments", at::kLong);
    check.expect(hyper, "hyper", at::kFloat);
    check(segments.dim() == 2 && segments.size(1) == kSegmentFields, "segments must be int64 [S, 5]");
    check(hyper.dim() == 2 && hyper.size(1) == hyper_fields,
          "hyper must be float32 [H, " + std::to_string(hyper_fields) + "]");
    const auto* table = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
    for (int64_t i = 0; i < segments.size(0); ++i) {
        const char* problem = segment_problem(table[i], partition, hyper.size(0), states, num_states);
        check(problem == nullptr, "segment " + std::to_string(i) + ": " + (problem ? problem : ""));
    }
    return count_blocks(table, segments.size(0), [](const Segment&) { return true; });
}

// The master weights of an operator's `params` and `error` (fp32; bf16; bf16 with int8 error terms), checked.
inline Master master_of(const Checker& check, const at::Tensor& params, const std::optional<at::Tensor>& error) {
    check(params.device().is_cpu() && params.is_contiguous(), "params must be a contiguous CPU tensor");
    if (params.scalar_type() == at::kFloat) {
        check(!error.has_value(), "error (the int8 error terms of compensated master weights) goes with bfloat16 "
                                  "params, got float32 params");
        return {MasterKind::kFloat32, params.data_ptr<float>(), nullptr};
    }
    check(params.scalar_type() == at::kBFloat16,
          std::string("params must be float32 or bfloat16, got ") + c10::toString(params.scalar_type()));
    if (!error.has_value()) return {MasterKind::kBFloat16, params.data_ptr(), nullptr};
    check.expect(*error, "error", at::kChar);
    check(error->numel() == params.numel(), "error and params differ in size");
    return {MasterKind::kCompensated, params.data_ptr(), error->data_ptr<int8_t>()};
}

// The model's copy of the updated master weights (lp_params: DeepSpeed's low-precision partition, or the pinned buffer
// its CPU offload copies to the device): written by the kernel for every element it steps, from the block it has in
// cache, where DeepSpeed's step otherwise converts the whole fp32 partition in a pass of its own after the optimizer
// (6 bytes per element of memory traffic beside the 8-bit step's 16). Its bits are torch's fp32 -> bf16 conversion
// (round to nearest even), NaN aside: a NaN is stored as 0x7FC0, torch's scalar conversion (its vectorized one
// writes 0xFFFF).
enum class CopyKind : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2 };

struct ModelCopy {
    CopyKind kind;  // none asked for, an fp32 model's weights, or bf16 bits
    void* values;   // float* or uint16_t* over the partition; null for kNone
};

// The operator's lp_params, checked: only beside fp32 master weights (bf16 ones are the model's copy themselves), the
// partition's size, fp32 or bf16, not overlapping the master weights.
inline ModelCopy model_copy_of(const Checker& check, const Master& master, const at::Tensor& params,
                               const std::optional<at::Tensor>& lp_params) {
    if (!lp_params.has_value()) return {CopyKind::kNone, nullptr};
    const at::Tensor& lp = *lp_params;
    check(master.kind == MasterKind::kFloat32, "lp_params (the model's copy of the updated weights) goes with float32 "
                                               "master weights; bf16 master weights are that copy themselves");
    check(lp.device().is_cpu() && lp.is_contiguous(), "lp_params must be a contiguous CPU tensor");
    check(lp.numel() == params.numel(), "lp_params and params differ in size (" + std::to_string(lp.numel()) +
                                            " and " + std::to_string(params.numel()) + " elements)");
    const auto* lp_first = static_cast<const char*>(lp.data_ptr());
    const auto* p_first = static_cast<const char*>(params.data_ptr());
    check(lp.numel() == 0 || lp_first + lp.nbytes() <= p_first || p_first + params.nbytes() <= lp_first,
          "lp_params overlaps params (the copy must be a tensor of its own)");
    if (lp.scalar_type() == at::kFloat) return {CopyKind::kFloat32, lp.data_ptr()};
    check(lp.scalar_type() == at::kBFloat16, std::string("lp_params must be float32 or bfloat16, got ") +
                                                 c10::toString(lp.scalar_type()));
    return {CopyKind::kBFloat16, lp.data_ptr()};
}

// out[j] = the bf16 bits of p[j] (bf16_round), j < len: bf16 master weights and the model's bf16 copy; 16 at a time
// where AVX-512 is compiled in (master_weights_avx512.h: one conversion instruction where AVX512_BF16 is), else the
// compiler's loop.
inline void store_bf16(uint16_t* out, const float* p, int64_t len) {
#if DSBNB_AVX512
    avx512::store_bf16(out, p, len);
#else
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) out[j] = bf16_round(p[j]);
#endif
}

// Writes the model's copy of the updated fp32 weights p of the block base..base+len.
inline void store_model_copy(const ModelCopy& copy, int64_t base, int64_t len, const float* p) {
    if (copy.kind == CopyKind::kFloat32) {
        std::memcpy(static_cast<float*>(copy.values) + base, p, static_cast<size_t>(len) * sizeof(float));
    } else if (copy.kind == CopyKind::kBFloat16) {
        store_bf16(static_cast<uint16_t*>(copy.values) + base, p, len);
    }
}

// Asks the caches for kLines 64-byte lines from `offset` bytes past `base` (a hint: it cannot fault, whatever the
// address; integer arithmetic, since the range may pass the end of the array). Always inlined, as is prefetch_block:
// gcc finds a function that only prefetches free of effects and deletes the calls to it.
template <int kLines, int kForWrite>
__attribute__((always_inline)) inline void prefetch_lines(const void* base, int64_t offset) {
    const uintptr_t first = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(offset);
#pragma GCC unroll 16
    for (int line = 0; line < kLines; ++line) {
        __builtin_prefetch(reinterpret_cast<const void*>(first + 64 * line), kForWrite);
    }
}

// The lines of the 8-bit block that starts at element `at` of the partition (the one after the block being stepped):
// its master weights, gradients and codes (c2: null for one-state rules), and the model's copy it writes. In a
// training step the partition comes from memory, not the caches (the backward pass ran in between), and the hardware
// prefetcher does not run far enough ahead of a block's many operations: measured on the AdamW kernel, 0.44M elements
// after a 32 MB pass, one thread, 0.75-0.80 -> 0.61-0.64 ms (one block ahead; two and four blocks ahead gained less),
// the same from the caches. The copy's lines are stored to, not read, but a store to a line not in the cache first
// reads it in: with an fp32 model's copy ahead, the step writing it took 0.68-0.77 ms against 0.73-0.85 (Zen 4, 11
// runs of each in turn); a bf16 copy, half the lines, measured the same either way.
template <typename GradT>
__attribute__((always_inline)) inline void prefetch_block(const Master& master, const GradT* grads, const uint8_t* c1,
                                                         const uint8_t* c2, int64_t at, const ModelCopy& copy) {
    static_assert(kBlock == 256, "the line counts below are those of a 256-element block");
    if (copy.kind == CopyKind::kFloat32) {
        prefetch_lines<16, 1>(copy.values, at * 4);
    } else if (copy.kind == CopyKind::kBFloat16) {
        prefetch_lines<8, 1>(copy.values, at * 2);
    }
    if (master.kind == MasterKind::kFloat32) {
        prefetch_lines<16, 1>(master.values, at * 4);
    } else {
        prefetch_lines<8, 1>(master.values, at * 2);
        if (master.kind == MasterKind::kCompensated) prefetch_lines<4, 1>(master.error, at);
    }
    prefetch_lines<4 * static_cast<int>(sizeof(GradT)), 0>(grads, at * static_cast<int64_t>(sizeof(GradT)));
    prefetch_lines<4, 1>(c1, at);
    if (c2 != nullptr) prefetch_lines<4, 1>(c2, at);
}

// Runs step(p) with p the fp32 master weights of the block base..base+len: the partition's own when they are fp32
// (then the model's copy, if asked for, written from them); else a widened copy, stored back after (every element:
// an unchanged one goes back to the same bits, NaN aside).
template <typename Step>
inline void with_fp32_master(const Master& master, const ModelCopy& copy, int64_t base, int64_t len, Step&& step) {
    if (master.kind == MasterKind::kFloat32) {
        float* p = static_cast<float*>(master.values) + base;
        step(p);
        store_model_copy(copy, base, len, p);
        return;
    }
    // one loop per kind, not a switch per element: each vectorizes
    alignas(64) float p[kBlock];
    const uint16_t* hi = static_cast<const uint16_t*>(master.values) + base;
    if (master.kind == MasterKind::kBFloat16) {
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) p[j] = bf16_value(hi[j]);
    } else {
        const int8_t* lo = master.error + base;
        // 16 at a time where AVX-512 is compiled in (master_weights_avx512.h), else 8 at a time where AVX2 is
        // (master_weights_avx2.h), the rest here
        int64_t j = 0;
#if DSBNB_AVX512
        for (; j + 16 <= len; j += 16) _mm512_store_ps(p + j, avx512::join16(hi + j, lo + j));
#elif defined(__AVX2__)
        for (; j + 8 <= len; j += 8) _mm256_store_ps(p + j, avx2::join8(hi + j, lo + j));
#endif
#pragma omp simd
        for (int64_t k = j; k < len; ++k) p[k] = join(hi[k], lo[k]);
    }
    step(p);
    uint16_t* hi_out = static_cast<uint16_t*>(master.values) + base;
    if (master.kind == MasterKind::kBFloat16) {
        store_bf16(hi_out, p, len);
    } else {
        int8_t* lo_out = master.error + base;
        int64_t j = 0;
#if DSBNB_AVX512
        for (; j + 16 <= len; j += 16) avx512::split16(_mm512_load_ps(p + j), hi_out + j, lo_out + j);
#elif defined(__AVX2__)
        for (; j + 8 <= len; j += 8) avx2::split8(_mm256_load_ps(p + j), hi_out + j, lo_out + j);
#endif
#pragma omp simd
        for (int64_t k = j; k < len; ++k) split(p[k], hi_out[k], lo_out[k]);
    }
}

// Calls f(grad pointer, std::integral_constant<bool, scale>) with the typed gradient pointer: one instantiation per
// gradient dtype (fp32, bf16, fp16) and scaling.
template <typename F>
void dispatch(const Checker& check, const at::Tensor& params, const at::Tensor& grads, double inv_scale, F&& f) {
    check(grads.device().is_cpu() && grads.is_contiguous(), "grads must be a contiguous CPU tensor");
    check(grads.numel() == params.numel(), "grads and params differ in size");
    const bool scale = inv_scale != 1.0;
    auto with_scale = [&](auto* grad_ptr) {
        if (scale) {
            f(grad_ptr, std::true_type{});
        } else {
            f(grad_ptr, std::false_type{});
        }
    };
    switch (grads.scalar_type()) {
        case at::kFloat: with_scale(grads.data_ptr<float>()); break;
        case at::kBFloat16: with_scale(grads.data_ptr<c10::BFloat16>()); break;
        case at::kHalf: with_scale(grads.data_ptr<c10::Half>()); break;
        default: check(false, std::string("grads must be float32, bfloat16 or float16, got ") +
                                  c10::toString(grads.scalar_type()));
    }
}

// Runs block(segment, start, len, base) for every work item of `plan` on ATen's thread pool: the block's first element
// inside its segment, its length (up to 256) and its first element in the partition.
template <typename Block>
void for_each_block(const at::Tensor& segments, const BlockPlan& plan, Block&& block) {
    const auto* table = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
    const std::vector<int64_t>& first = plan.first;
    at::parallel_for(0, plan.blocks(), 16, [&](int64_t begin, int64_t end) {
        // the segment of item `begin`: the last one whose first item is at or before it (empty ones are skipped)
        int64_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
        for (int64_t w = begin; w < end; ++w) {
            while (w >= first[i + 1]) ++i;
            const Segment& s = table[i];
            const int64_t start = (w - first[i]) * kBlock;
            const int64_t len = std::min<int64_t>(kBlock, s.numel - start);
            const int64_t base = s.offset + start;
            block(s, start, len, base);
        }
    });
}

// --- one-state rules (Lion, SGD-momentum): everything but the arithmetic -----------------------------------------
// A Rule provides: `using Row` (its hyper-table row) and `kHyperFields`; `element(row, p_old, m_old, g, p, m)`, the new
// parameter and momentum of one element with a finite gradient (inlined into one_state_update's vectorized loop);
// `bnb32(row, p_old, m_old, g, p, m)`, the same in the 'bnb_cpu' arithmetic of fp32 segments (bnb_cpu32.h); and,
// where DSBNB_AVX512, `full_block<kind, Scale>(row, p, g, codes, absmax, fast tables, inv_scale, m, max)`, the
// register update of a full block that returns false when a new momentum is NaN.

// The portable update of up to one block of a one-state rule: writes p and the new momentum m (a non-finite gradient
// keeps both). m may alias m_old (fp32 state updated in place).
template <typename Rule, typename GradT, bool Scale>
void one_state_update(const typename Rule::Row& hyper, int64_t len, float* __restrict__ p,
                      const GradT* __restrict__ g_in, const float* m_old, float inv_scale, float* m) {
    const typename Rule::Row h = hyper;  // a local copy: the compiler need not reload it around stores through p
    alignas(64) float g[kBlock];
    widen_grads<GradT, Scale>(len, g_in, inv_scale, g);
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        const float old = m_old[j], p_old = p[j];
        float pn, mn;
        Rule::element(h, p_old, old, g[j], pn, mn);
        const bool ok = finite(g[j]);
        p[j] = select(ok, pn, p_old);
        m[j] = select(ok, mn, old);
    }
}

// The 'bnb_cpu' update of up to one block of a one-state rule's fp32 segment (bnb_cpu32.h): p and the momentum m in
// place, every element (bnb lets a non-finite gradient into the state).
template <typename Rule, typename GradT, bool Scale>
void bnb32_one_state_update(const typename Rule::Row& hyper, int64_t len, float* __restrict__ p,
                            const GradT* __restrict__ g_in, float inv_scale, float* __restrict__ m) {
    const typename Rule::Row h = hyper;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) {
        float pn, mn;
        Rule::bnb32(h, p[j], m[j], bnb32::grad<GradT, Scale>(g_in[j], inv_scale), pn, mn);
        p[j] = pn;
        m[j] = mn;
    }
}

// One block (up to 256 elements) of an 8-bit segment: update, absmax, requantize. Full blocks of bnb-style maps take
// the AVX-512 path where it is compiled in; the rest the portable loops. Both give the same bits.
template <typename Rule, typename GradT, bool Scale>
void one_state_block(const typename Rule::Row& hyper, int64_t len, float* __restrict__ p,
                     const GradT* __restrict__ g_in, uint8_t* __restrict__ c1, float* a1, const float* __restrict__ q1,
                     const MapTables& t1, float inv_scale) {
    alignas(64) float m[kBlock];
    float max1;
#if DSBNB_AVX512
    if (len == kBlock && t1.fast_usable()) {
        const bool nan_free = Rule::template full_block<grad_kind<GradT>(), Scale>(hyper, p, g_in, c1, *a1, t1.fast,
                                                                                    inv_scale, m, max1);
        if (!nan_free) max1 = block_absmax(len, m);  // a NaN momentum: the first-NaN rule
        quantize_full_block(t1, m, max1, nan_free, c1);
        *a1 = max1;
        return;
    }
#endif
    alignas(64) float m_old[kBlock];
    dequantize_block(len, c1, *a1, q1, m_old);
    one_state_update<Rule, GradT, Scale>(hyper, len, p, g_in, m_old, inv_scale, m);
    max1 = block_absmax(len, m);
    quantize_block(len, m, reciprocal(max1), c1, t1);
    *a1 = max1;
}

// The operator body of a one-state rule: argument checks, the segment plan, dtype dispatch and the parallel walk.
template <typename Rule>
void one_state_step(const char* op, at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
                    at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments, const at::Tensor& hyper,
                    const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& error,
                    c10::string_view arithmetic, const std::optional<at::Tensor>& lp_params) {
    const Checker check(op);
    const bool bnb_cpu = bnb_cpu_arithmetic(check, arithmetic);
    choose_key_lookup(check);
    const double inv_scale = scale_of(check, scale);
    const Master master = master_of(check, params, error);
    const ModelCopy copy = model_copy_of(check, master, params, lp_params);
    check.expect(codes1, "codes1", at::kByte);
    check.expect(absmax1, "absmax1", at::kFloat);
    check.expect(state1, "state1", at::kFloat);
    check.expect(qmap1, "qmap1", at::kFloat);
    check(qmap1.numel() == 256, "qmap1 must hold 256 entries");
    const StateSizes states[1] = {{codes1.numel(), absmax1.numel(), state1.numel()}};
    const BlockPlan work = plan_blocks(check, segments, hyper, Rule::kHyperFields, params.numel(), states, 1);
    const MapTables& t1 = tables_for(qmap1);
    const float inv = static_cast<float>(inv_scale);
    const auto* h = reinterpret_cast<const typename Rule::Row*>(hyper.data_ptr<float>());
    uint8_t* c1 = codes1.data_ptr<uint8_t>();
    float* a1 = absmax1.data_ptr<float>();
    float* s1 = state1.data_ptr<float>();
    const float* q1 = qmap1.data_ptr<float>();
    dispatch(check, params, grads, inv_scale, [&](auto* g, auto scale) {
        using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        constexpr bool kScale = decltype(scale)::value;
        for_each_block(segments, work, [&](const Segment& s, int64_t start, int64_t len, int64_t base) {
            if (s.eight_bit) prefetch_block(master, g, c1, nullptr, base + kBlock, copy);
            with_fp32_master(master, copy, base, len, [&](float* p) {
                if (s.eight_bit) {
                    one_state_block<Rule, G, kScale>(h[s.hyper_row], len, p, g + base, c1 + base, a1 + base / kBlock,
                                                     q1, t1, inv);
                } else if (bnb_cpu) {
                    bnb32_one_state_update<Rule, G, kScale>(h[s.hyper_row], len, p, g + base, inv,
                                                            s1 + s.fp32_offset + start);
                } else {
                    float* m = s1 + s.fp32_offset + start;
                    one_state_update<Rule, G, kScale>(h[s.hyper_row], len, p, g + base, m, inv, m);
                }
            });
        });
    });
}

}  // namespace cpu
}  // namespace dsbnb
