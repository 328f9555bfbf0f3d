// ops.cpp — the schema of deepspeed_bnb's operators, defined once (torch.library). Implementations register per device:
// csrc/cpu/adam8bit_cpu.cpp, lion8bit_cpu.cpp and momentum8bit_cpu.cpp (CPU), csrc/cuda/adam8bit_cuda.cpp,
// lion8bit_cuda.cpp and momentum8bit_cuda.cpp (CUDA); the pure-torch references with the same signatures are in
// deepspeed_bnb/ops/reference.py, the shape-only (fake) implementations in deepspeed_bnb/ops/fake.py. Each operator is
// one update rule of deepspeed_bnb/ops/rules.py, which gives its argument layout (tests/unit/test_rules.py holds these
// schemas to it). Build: see deepspeed_bnb/ops/loader.py.
#include <torch/library.h>

// Every operator steps fp32 master weights, bf16 ones (params bf16), or compensated ones (params bf16 and error, their
// int8 error terms): csrc/include/dsbnb/master_weights.h. inv_scale: None, or a one-element float32 tensor on params'
// device holding DeepSpeed's unscale/clip factor (read by the kernel, so the host never waits for its value).
// lp_params: None, or the model's copy of the updated weights (fp32 or bf16, bf16 only on a GPU; the partition's size,
// beside fp32 master weights), written by the kernel for every element it steps (DeepSpeed's low-precision partition
// or its offload buffer, so that its own conversion pass after the step is not needed: runtime/zero/lp_copy.py).
// arithmetic: "ieee" (every fp32 operation rounded on its own: the reference's, on every device), "bnb_cuda" (CUDA:
// bitsandbytes' own CUDA kernels' rounding) or "bnb_cpu" (CPU: "ieee" for 8-bit segments, bnb's own 32-bit CPU update
// for fp32 ones); deepspeed_bnb/ops/rules.py names them.
TORCH_LIBRARY(deepspeed_bnb, m) {
    // One fused AdamW step of a flat ZeRO partition, in place (see deepspeed_bnb/ops/reference.py for semantics).
    // segments: int64 [S, 5] (offset, numel, eight_bit, fp32_offset, hyper_row); hyper: float32 [H, 7]
    // (beta1, beta2, 1 - beta1, 1 - beta2, eps * c2, 1 - lr * wd, -lr * c2 / (1 - beta1^t)), c2 = sqrt(1 - beta2^t).
    m.def("adam8bit_step_(Tensor(a!) params, Tensor grads, Tensor(b!) codes1, Tensor(c!) codes2, "
          "Tensor(d!) absmax1, Tensor(e!) absmax2, Tensor(f!) state1, Tensor(g!) state2, Tensor qmap1, "
          "Tensor qmap2, Tensor segments, Tensor hyper, Tensor? inv_scale, Tensor(h!)? error=None, "
          "str arithmetic='ieee', Tensor(i!)? lp_params=None) -> ()");
    // One fused Lion step of a flat ZeRO partition, in place (semantics: reference.py, lion8bit_step). One state, the
    // momentum: codes1/absmax1 (8-bit segments, signed map qmap1) or state1 (fp32 segments). segments as above;
    // hyper: float32 [H, 6] (beta1, beta2, 1 - beta1, 1 - beta2, 1 - lr * wd, lr).
    m.def("lion8bit_step_(Tensor(a!) params, Tensor grads, Tensor(b!) codes1, Tensor(c!) absmax1, Tensor(d!) state1, "
          "Tensor qmap1, Tensor segments, Tensor hyper, Tensor? inv_scale, Tensor(e!)? error=None, "
          "str arithmetic='ieee', Tensor(f!)? lp_params=None) -> ()");
    // One fused SGD-with-momentum step (bnb's "momentum" rule; semantics: reference.py, momentum8bit_step). Arguments
    // as lion8bit_step_; hyper: float32 [H, 4] (beta1, weight_decay, lr, first: nonzero at step 1).
    m.def("momentum8bit_step_(Tensor(a!) params, Tensor grads, Tensor(b!) codes1, Tensor(c!) absmax1, "
          "Tensor(d!) state1, Tensor qmap1, Tensor segments, Tensor hyper, Tensor? inv_scale, "
          "Tensor(e!)? error=None, str arithmetic='ieee', Tensor(f!)? lp_params=None) -> ()");
}
