// kernel_variants.cu — the fused kernels of every rule compiled in several launch shapes (fused_step.cuh's Tuning:
// blocks per SM the register budget allows; a separate body for full blocks), for a side-by-side sweep on a GPU
// (tests/gpu/part_variants.py): which shape moves the most bytes, each bit for bit with the others.
// What it compiles: the rules the product's kernels use (csrc/cuda/*_rules.cuh), so that every variant is the
// product's source with another Tuning, in bitsandbytes' CUDA arithmetic with fp32 master weights (what a ZeRO step
// runs on a GPU); the product's builds compile each rule's own shape (Rule::Shape) only.
// Build: by the part, with torch's JIT and the kernels' flags (deepspeed_bnb/ops/build_flags.py), include paths
// csrc/include and csrc/cuda. Test: tests/gpu/part_variants.py compiles it with nvcc alone on a machine without a GPU.

#include "adam8bit_rules.cuh"
#include "lion8bit_rules.cuh"
#include "momentum8bit_rules.cuh"

#include "kernel_variants.h"

namespace dsbnb {
namespace variants {
namespace {

template <typename Rule, typename Tune>
int launch_fp32(const StepArgs& a, bool, void* stream) {
    return device::launch_kind<Rule, MasterKind::kFloat32, Tune>(a, stream);
}

template <typename Rule, typename Tune>
int info_of(int* registers, int* blocks_per_sm) {
    auto kernel = device::fused_step_kernel<Rule, MasterKind::kFloat32, Tune>;
    cudaFuncAttributes attributes;
    cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) return static_cast<int>(status);
    *registers = attributes.numRegs;
    status = device::allow_dynamic_shared<Tune>(kernel);  // as the launch asks for it (device::launch_kind)
    if (status != cudaSuccess) return static_cast<int>(status);
    return static_cast<int>(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks_per_sm, kernel, device::kWarps * 32, device::dynamic_shared_bytes<Tune>()));
}

// The shapes compared after each rule's own (variant 0, Rule::Shape): the best shape per rule in the first sweeps
// (AdamW: 4 blocks per SM with the index ahead; Lion: 3 with it); the quantizer compiled as the compact table alone
// (bnb's maps have one) at 3 and 4 blocks per SM, with two full blocks per warp step (2 blocks per SM), and with the
// index ahead; the staged loop (the next block's bytes copied into shared memory while a block is stepped) at 2, 3 and
// 4 blocks per SM (the table-only quantizer; 3 with either); and each element's choices as selects (no branch per
// element: the lane's 8 elements interleave) with the product's quantizer, the table-only one, the table-only one
// staged, and two full blocks per warp step. The single body with per-element bounds checks (the kernels' first
// shape, 39-55% of a copy on an H200) is no longer swept.
using Shapes = std::tuple<device::Tuning<4, true, true>, device::Tuning<3, true, true>,
                          device::Tuning<3, true, false, 1, true>, device::Tuning<4, true, false, 1, true>,
                          device::Tuning<4, true, true, 1, true>, device::Tuning<2, true, false, 2, true>,
                          device::Tuning<3, true, false, 1, false, true>, device::Tuning<3, true, false, 1, true, true>,
                          device::Tuning<2, true, false, 1, true, true>, device::Tuning<4, true, false, 1, true, true>,
                          device::Tuning<3, true, false, 1, false, false, true>,
                          device::Tuning<3, true, false, 1, true, false, true>,
                          device::Tuning<3, true, false, 1, true, true, true>,
                          device::Tuning<2, true, false, 2, true, false, true>>;
constexpr int kShapes = std::tuple_size<Shapes>::value + 1;  // variant 0: the rule's own

// Variant V of Rule: its product shape, then the tuple's.
template <typename Rule, int V>
using ShapeOf = std::conditional_t<V == 0, typename Rule::Shape, std::tuple_element_t<(V > 0 ? V - 1 : 0), Shapes>>;

// The launcher and the facts of shape V of Rule (a recursion over the shapes: nvcc's host pass rejects a pack of
// kernel-template addresses).
template <typename Rule, int V = 0>
Launch launch_for(int variant) {
    if constexpr (V == kShapes) {
        return nullptr;
    } else {
        return variant == V ? &launch_fp32<Rule, ShapeOf<Rule, V>> : launch_for<Rule, V + 1>(variant);
    }
}

template <typename Rule, int V = 0>
Info info_for(int variant) {
    if constexpr (V == kShapes) {
        return nullptr;
    } else {
        return variant == V ? &info_of<Rule, ShapeOf<Rule, V>> : info_for<Rule, V + 1>(variant);
    }
}

template <typename Rule, int V = 0>
void describe(int variant, char* name, size_t size) {
    if constexpr (V < kShapes) {
        using Tune = ShapeOf<Rule, V>;
        if (variant != V) return describe<Rule, V + 1>(variant, name, size);
        snprintf(name, size, "%s%d blocks/SM%s%s%s%s%s%s", V == 0 ? "product: " : "", Tune::kMinBlocks,
                 Tune::kSplitFull ? ", full-block body" : "", Tune::kPrefetchSegment ? ", index ahead" : "",
                 Tune::kBlocksPerStep == 2 ? ", 2 blocks per warp step" : "",
                 Tune::kFastMaps ? ", table-only quantizer" : "", Tune::kStaged ? ", staged in shared memory" : "",
                 Tune::kSelects ? ", selects" : "");
    }
}

// Shape V's Tuning arguments as DEEPSPEED_BNB_CUDA_SHAPE takes them (deepspeed_bnb/ops/build_flags.py), e.g.
// "3,true,false,1,true,false,true": what a build measures as the product, and what a rule's line names.
template <typename Rule, int V = 0>
void arguments(int variant, char* text, size_t size) {
    if constexpr (V < kShapes) {
        using Tune = ShapeOf<Rule, V>;
        if (variant != V) return arguments<Rule, V + 1>(variant, text, size);
        const auto word = [](bool on) { return on ? "true" : "false"; };
        snprintf(text, size, "%d,%s,%s,%d,%s,%s,%s", Tune::kMinBlocks, word(Tune::kSplitFull),
                 word(Tune::kPrefetchSegment), Tune::kBlocksPerStep, word(Tune::kFastMaps), word(Tune::kStaged),
                 word(Tune::kSelects));
    }
}

// A rule's type carried as a value, for the generic lambdas of with_rule.
template <typename Rule>
struct RuleTag {
    using type = Rule;
};

// f(RuleTag<R>{}) for rule 0 (AdamW), 1 (Lion) or 2 (SGD-momentum), R its rules in bitsandbytes' CUDA arithmetic;
// false (f not called) for any other rule.
template <typename F>
bool with_rule(int rule, F&& f) {
    switch (rule) {
        case 0: f(RuleTag<cuda_rules::AdamBnb>{}); return true;
        case 1: f(RuleTag<cuda_rules::LionBnb>{}); return true;
        case 2: f(RuleTag<cuda_rules::MomentumBnb>{}); return true;
        default: return false;
    }
}

// The text write(RuleTag, variant, buffer, size) gives for a rule and variant, kept in `texts`; null out of range
// (with_rule answers for the rule, so `texts` is indexed only by a rule it knows).
template <size_t N, typename Write>
const char* text_of(char (&texts)[3][kShapes][N], int rule, int variant, Write write) {
    if (variant < 0 || variant >= kShapes) return nullptr;
    const char* found = nullptr;
    with_rule(rule, [&](auto tag) {
        write(tag, variant, texts[rule][variant], N);
        found = texts[rule][variant];
    });
    return found;
}

}  // namespace

int count() { return kShapes; }

const char* shape(int rule, int variant) {
    static char texts[3][kShapes][48];
    return text_of(texts, rule, variant, [](auto tag, int v, char* text, size_t size) {
        arguments<typename decltype(tag)::type>(v, text, size);
    });
}

const char* name(int rule, int variant) {
    static char names[3][kShapes][112];
    return text_of(names, rule, variant, [](auto tag, int v, char* text, size_t size) {
        describe<typename decltype(tag)::type>(v, text, size);
    });
}

Launch launcher(int rule, int variant) {
    Launch found = nullptr;
    with_rule(rule, [&](auto tag) { found = launch_for<typename decltype(tag)::type>(variant); });
    return found;
}

Info info(int rule, int variant) {
    Info found = nullptr;
    with_rule(rule, [&](auto tag) { found = info_for<typename decltype(tag)::type>(variant); });
    return found;
}

}  // namespace variants
}  // namespace dsbnb
