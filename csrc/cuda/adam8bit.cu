// adam8bit.cu — the CUDA kernels of deepspeed_bnb::adam8bit_step_: one fused 8-bit AdamW step over a whole ZeRO
// partition, 8-bit and 32-bit state in one launch (the kernel: fused_step.cuh), in either arithmetic:
//   ieee      the project's AdamW (decoupled decay, IEEE fp32 operations): deepspeed_bnb/ops/reference.py, bit for
//             bit, the CPU kernel's arithmetic (csrc/include/dsbnb/adam8bit.h, shared with it);
//   bnb_cuda  bitsandbytes' own CUDA Adam kernels, operation by operation (csrc/include/dsbnb/bnb_cuda_math.h:
//             kOptimizerStatic8bit2StateBlockwise for 8-bit state, kOptimizer32bit2State for 32-bit state).
// References: bitsandbytes 0.50.2 csrc/kernels.cu, llm.c's AdamW kernel, torch's multi-tensor apply.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with the binding
// (adam8bit_cuda.cpp). It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/adam8bit.cu -o /tmp/adam8bit.o
// Flags that keep the ieee arithmetic exact: -fmad=false, and no --use_fast_math (the bnb_cuda one is explicit PTX).
// Test: pytest tests/kernels/test_fused_rules.py -k adam (ieee, where a GPU is present); the GPU proof's kernel part
// (bnb_cuda against bitsandbytes itself).

#include "adam8bit_rules.cuh"

namespace dsbnb {

int launch_adam8bit_step(const StepArgs& args, bool bnb, void* stream) {
    return bnb ? device::launch<cuda_rules::AdamBnb>(args, stream)
               : device::launch<cuda_rules::AdamIeee>(args, stream);
}

}  // namespace dsbnb
