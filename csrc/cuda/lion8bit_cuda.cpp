// lion8bit_cuda.cpp — the torch binding of the CUDA Lion kernels (lion8bit.cu): checks the arguments and
// launches on the current stream, with the map's quantizer tables and the segment table's block map cached per tensor
// like the other bindings (fused_cuda.h), so a steady-state step never synchronizes with the device.
// Registered as the CUDA implementation of deepspeed_bnb::lion8bit_step_ (schema: csrc/ops.cpp).
// Build: only with a CUDA build of torch, by deepspeed_bnb/ops/loader.py (JIT) or setup.py (prebuilt).
// Test: pytest tests/kernels/test_fused_rules.py -k lion on a machine with a GPU; tests/kernels/test_cuda_build.py
// checks its syntax.

#include "fused_cuda.h"

namespace {

void lion8bit_step_cuda(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
                        at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments,
                        const at::Tensor& hyper, const std::optional<at::Tensor>& inv_scale,
                        const std::optional<at::Tensor>& error, c10::string_view arithmetic,
                        const std::optional<at::Tensor>& lp_params) {
    dsbnb::binding::run("lion8bit_step_", &dsbnb::launch_lion8bit_step, params, grads,
                        {{&codes1, &absmax1, &state1, &qmap1}}, segments, hyper, dsbnb::kLionHyperFields, inv_scale,
                        error, arithmetic, lp_params);
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CUDA, m) { m.impl("lion8bit_step_", &lion8bit_step_cuda); }
