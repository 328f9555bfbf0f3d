// momentum8bit.cu — the CUDA kernels of deepspeed_bnb::momentum8bit_step_: one fused 8-bit SGD-with-momentum step
// (bnb's "momentum" rule) over a whole ZeRO partition, 8-bit and 32-bit state in one launch (the kernel:
// fused_step.cuh), in either arithmetic:
//   ieee      the project's rule (coupled decay, m = g at step 1, IEEE fp32 operations):
//             deepspeed_bnb/ops/reference.py (momentum8bit_step), bit for bit; the per-element arithmetic is shared
//             with the CPU kernel through csrc/include/dsbnb/adam8bit.h;
//   bnb_cuda  bitsandbytes' own CUDA kernels (csrc/include/dsbnb/bnb_cuda_math.h:
//             kOptimizerStatic8bit1StateBlockwise<MOMENTUM>, kOptimizer32bit1State<MOMENTUM>).
// References: bitsandbytes 0.50.2 csrc/kernels.cu and optim/sgd.py.
// Build: with a CUDA build of torch, deepspeed_bnb/ops/loader.py JIT-compiles it with its binding
// (momentum8bit_cuda.cpp). It includes no torch header, so it also compiles alone, which CI checks without a GPU:
//   nvcc -c -std=c++17 -O3 -fmad=false -Icsrc/include -gencode arch=compute_80,code=sm_80 \
//        -gencode arch=compute_90,code=sm_90 csrc/cuda/momentum8bit.cu -o /tmp/momentum8bit.o
// Flags that keep the ieee arithmetic exact: -fmad=false, and no --use_fast_math.
// Test: pytest tests/kernels/test_fused_rules.py -k momentum (ieee, where a GPU is present);
// tests/kernels/test_cuda_build.py; the GPU proof's kernel part (bnb_cuda against bitsandbytes itself).

#include "momentum8bit_rules.cuh"

namespace dsbnb {

int launch_momentum8bit_step(const StepArgs& args, bool bnb, void* stream) {
    return bnb ? device::launch<cuda_rules::MomentumBnb>(args, stream)
               : device::launch<cuda_rules::MomentumIeee>(args, stream);
}

}  // namespace dsbnb
