// lion8bit.cu — the CUDA kernels of deepspeed_bnb::lion8bit_step_: one fused 8-bit Lion step over a whole ZeRO
// partition, 8-bit and 32-bit state in one launch (the kernel: fused_step.cuh), in either arithmetic:
//   ieee      the project's Lion (decoupled decay before the signed step, IEEE fp32 operations):
//             deepspeed_bnb/ops/reference.py (lion8bit_step), bit for bit; the per-element arithmetic is shared with
//             the CPU kernel through csrc/include/dsbnb/adam8bit.h;
//   bnb_cuda  bitsandbytes' own CUDA Lion kernels (csrc/include/dsbnb/bnb_cuda_math.h:
//             kOptimizerStatic8bit1StateBlockwise<LION>, kOptimizer32bit1State<LION>).
// References: bitsandbytes 0.50.2 csrc/kernels.cu; Chen et al., Symbolic Discovery of Optimization Algorithms.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding (lion8bit_cuda.cpp).
// It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/lion8bit.cu -o /tmp/lion8bit.o
// Flags that keep the ieee arithmetic exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/kernels/test_fused_rules.py -k lion (ieee, where a GPU is present);
// tests/kernels/test_cuda_build.py; the GPU proof's kernel part (bnb_cuda against bitsandbytes itself).

#include "lion8bit_rules.cuh"

namespace dsbnb {

int launch_lion8bit_step(const StepArgs& args, bool bnb, void* stream) {
    return bnb ? device::launch<cuda_rules::LionBnb>(args, stream)
               : device::launch<cuda_rules::LionIeee>(args, stream);
}

}  // namespace dsbnb
