// kernel_variants_binding.cpp — torch operators over kernel_variants.cu, for the launch-shape sweep
// (tests/gpu/part_variants.py): dsbnb_variants::step (one fused step of a rule in one shape, the product's argument
// checks and cached tables: csrc/cuda/fused_cuda.h), ::count, ::name, ::shape (its Tuning arguments) and ::info
// (registers, resident blocks per SM).
// Build: with a CUDA build of torch, by the part (torch's JIT). Only bitsandbytes' CUDA arithmetic, fp32 master
// weights.

#include "fused_cuda.h"
#include "kernel_variants.h"

namespace {

void step(int64_t rule, int64_t variant, at::Tensor params, const at::Tensor& grads, at::Tensor codes1,
          at::Tensor codes2, at::Tensor absmax1, at::Tensor absmax2, at::Tensor state1, at::Tensor state2,
          const at::Tensor& qmap1, const at::Tensor& qmap2, const at::Tensor& segments, const at::Tensor& hyper) {
    const auto launch = dsbnb::variants::launcher(static_cast<int>(rule), static_cast<int>(variant));
    TORCH_CHECK(launch != nullptr, "dsbnb_variants::step: no rule ", rule, " variant ", variant, " (rules 0..2, ",
                "variants 0..", dsbnb::variants::count() - 1, ")");
    TORCH_CHECK(params.scalar_type() == at::kFloat, "dsbnb_variants::step: fp32 master weights only");
    if (rule == 0) {
        dsbnb::binding::run("variants::step", launch, params, grads,
                            {{&codes1, &absmax1, &state1, &qmap1}, {&codes2, &absmax2, &state2, &qmap2}}, segments,
                            hyper, dsbnb::kHyperFields, std::nullopt, std::nullopt, "bnb_cuda");
    } else {
        dsbnb::binding::run("variants::step", launch, params, grads, {{&codes1, &absmax1, &state1, &qmap1}}, segments,
                            hyper, dsbnb::kHyperFields, std::nullopt, std::nullopt, "bnb_cuda");
    }
}

int64_t count() { return dsbnb::variants::count(); }

std::string name(int64_t rule, int64_t variant) {
    const char* found = dsbnb::variants::name(static_cast<int>(rule), static_cast<int>(variant));
    TORCH_CHECK(found != nullptr, "dsbnb_variants::name: no rule ", rule, " variant ", variant);
    return found;
}

std::string shape(int64_t rule, int64_t variant) {
    const char* found = dsbnb::variants::shape(static_cast<int>(rule), static_cast<int>(variant));
    TORCH_CHECK(found != nullptr, "dsbnb_variants::shape: no rule ", rule, " variant ", variant);
    return found;
}

std::vector<int64_t> info(int64_t rule, int64_t variant) {
    const auto of = dsbnb::variants::info(static_cast<int>(rule), static_cast<int>(variant));
    TORCH_CHECK(of != nullptr, "dsbnb_variants::info: no rule ", rule, " variant ", variant);
    int registers = 0, blocks = 0;
    const int status = of(&registers, &blocks);
    TORCH_CHECK(status == 0, "dsbnb_variants::info: CUDA error ", status);
    return {registers, blocks};
}

}  // namespace

TORCH_LIBRARY(dsbnb_variants, m) {
    m.def("step(int rule, int variant, Tensor(a!) params, Tensor grads, Tensor(b!) codes1, Tensor(c!) codes2, "
          "Tensor(d!) absmax1, Tensor(e!) absmax2, Tensor(f!) state1, Tensor(g!) state2, Tensor qmap1, Tensor qmap2, "
          "Tensor segments, Tensor hyper) -> ()");
    // no tensor arguments, so nothing to dispatch on: one kernel for every key
    m.def("count() -> int", &count);
    m.def("name(int rule, int variant) -> str", &name);
    m.def("shape(int rule, int variant) -> str", &shape);
    m.def("info(int rule, int variant) -> int[]", &info);
}

TORCH_LIBRARY_IMPL(dsbnb_variants, CUDA, m) { m.impl("step", &step); }
