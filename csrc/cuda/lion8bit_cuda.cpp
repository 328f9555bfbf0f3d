// lion8bit_cuda.cpp — the torch binding of the CUDA Lion kernel (lion8bit.cu): checks the arguments and launches on
// the current stream, with the map's quantizer tables and the segment table's block offsets cached per tensor like
// the AdamW binding (fused_cuda.h), so a steady-state step never synchronizes with the device.
// Registered as the CUDA implementation of deepspeed_bnb::lion8bit_step_ (schema: csrc/ops.cpp).
// Build: only with a CUDA build of torch, by deepspeed_bnb/ops/loader.py (JIT) or setup.py (prebuilt).
// Test: pytest tests/test_fused_rules.py -k lion on a machine with a GPU; tests/test_cuda_build.py checks its syntax.

#include "fused_cuda.h"

namespace {

namespace binding = dsbnb::binding;

void lion8bit_step_cuda(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor absmax1,
                        at::Tensor state1, const at::Tensor& qmap1, const at::Tensor& segments,
                        const at::Tensor& hyper, const std::optional<at::Tensor>& inv_scale,
                        const std::optional<at::Tensor>& error, c10::string_view arithmetic) {
    const binding::Checker check("lion8bit_step_");
    const dsbnb::StateSizes states[1] = {{codes1.numel(), absmax1.numel(), state1.numel()}};
    const c10::cuda::CUDAGuard guard(params.device());
    const binding::SegmentBlocks& blocks = binding::check_and_plan(
        check, params, {&params, &grads, &codes1, &absmax1, &state1, &qmap1, &segments, &hyper},
        {&hyper, &absmax1, &state1, &qmap1}, {&codes1}, segments, hyper, dsbnb::kLionHyperFields, states, 1);
    check(qmap1.numel() == 256, "qmap1 must hold 256 entries");
    const dsbnb::GradType grad_type = binding::grad_type(check, grads);
    const int status = dsbnb::launch_lion8bit_step(
        reinterpret_cast<const dsbnb::Segment*>(segments.data_ptr<int64_t>()), blocks.starts.data_ptr<int64_t>(),
        segments.size(0), blocks.total, reinterpret_cast<const dsbnb::LionHyper*>(hyper.data_ptr<float>()),
        binding::master_of(check, params, error), grads.data_ptr(), grad_type, codes1.data_ptr<uint8_t>(),
        absmax1.data_ptr<float>(), state1.data_ptr<float>(), qmap1.data_ptr<float>(), binding::tables_for(qmap1),
        binding::scale_of(check, params, inv_scale, arithmetic), c10::cuda::getCurrentCUDAStream().stream());
    check(status == 0, "kernel launch failed with CUDA error " + std::to_string(status));
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CUDA, m) { m.impl("lion8bit_step_", &lion8bit_step_cuda); }
