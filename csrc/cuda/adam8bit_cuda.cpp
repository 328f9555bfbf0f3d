// adam8bit_cuda.cpp — the torch binding of the CUDA kernel (adam8bit.cu): checks the arguments, uploads the
// quantizer tables once per map and the segment block offsets once per segment table, and launches on the current
// stream. Steady state has no host-device synchronization: the maps and segment tables are constants of a run, so
// what the host derives from them is cached per tensor (fused_cuda.h, shared with the Lion binding lion8bit_cuda.cpp).
// Registered as the CUDA implementation of deepspeed_bnb::adam8bit_step_ (schema: csrc/ops.cpp).
// Build: only with a CUDA build of torch, by deepspeed_bnb/ops/loader.py (JIT) or setup.py (prebuilt).
// Test: pytest tests/test_fused_rules.py -k adam on a machine with a GPU.

#include "fused_cuda.h"

namespace {

namespace binding = dsbnb::binding;

void adam8bit_step_cuda(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor codes2,
                        at::Tensor absmax1, at::Tensor absmax2, at::Tensor state1, at::Tensor state2,
                        const at::Tensor& qmap1, const at::Tensor& qmap2, const at::Tensor& segments,
                        const at::Tensor& hyper, const std::optional<at::Tensor>& inv_scale,
                        const std::optional<at::Tensor>& error, c10::string_view arithmetic) {
    const binding::Checker check("adam8bit_step_");
    const dsbnb::StateSizes states[2] = {{codes1.numel(), absmax1.numel(), state1.numel()},
                                         {codes2.numel(), absmax2.numel(), state2.numel()}};
    const c10::cuda::CUDAGuard guard(params.device());
    const binding::SegmentBlocks& blocks = binding::check_and_plan(
        check, params,
        {&params, &grads, &codes1, &codes2, &absmax1, &absmax2, &state1, &state2, &qmap1, &qmap2, &segments, &hyper},
        {&hyper, &absmax1, &absmax2, &state1, &state2, &qmap1, &qmap2}, {&codes1, &codes2}, segments, hyper,
        dsbnb::kHyperFields, states, 2);
    check(qmap1.numel() == 256 && qmap2.numel() == 256, "qmap1 and qmap2 must hold 256 entries");
    const dsbnb::GradType grad_type = binding::grad_type(check, grads);
    const int status = dsbnb::launch_adam8bit_step(
        reinterpret_cast<const dsbnb::Segment*>(segments.data_ptr<int64_t>()), blocks.starts.data_ptr<int64_t>(),
        segments.size(0), blocks.total, reinterpret_cast<const dsbnb::Hyper*>(hyper.data_ptr<float>()),
        binding::master_of(check, params, error), grads.data_ptr(), grad_type, codes1.data_ptr<uint8_t>(),
        codes2.data_ptr<uint8_t>(), absmax1.data_ptr<float>(), absmax2.data_ptr<float>(), state1.data_ptr<float>(),
        state2.data_ptr<float>(), qmap1.data_ptr<float>(), qmap2.data_ptr<float>(), binding::tables_for(qmap1),
        binding::tables_for(qmap2),
        binding::scale_of(check, params, inv_scale, arithmetic), c10::cuda::getCurrentCUDAStream().stream());
    check(status == 0, "kernel launch failed with CUDA error " + std::to_string(status));
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CUDA, m) { m.impl("adam8bit_step_", &adam8bit_step_cuda); }
