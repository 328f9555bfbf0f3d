// bnb_cpu32.h — the CPU kernels' fp32-state segments in the "bnb_cpu" arithmetic: bitsandbytes' own 32-bit CPU update
// (a sequence of torch operations), element by element, so that one launch steps a partition's 32-bit-state
// parameters (biases, norms) with the bits bnb's own update gives them, instead of a bnb call per parameter run.
//
// What bnb 0.50's `_optimizer_update_32bit_cpu` computes, and why each line here is what it is:
// - `state1.mul_(beta1).add_(g, alpha=1 - beta1)`: torch's add with alpha is a fused multiply-add
//   (`vec::fmadd(other, alpha, self)`), so m = fma(g, 1 - beta1, m * beta1);
// - `state2.mul_(beta2).addcmul_(g, g, value=1 - beta2)`: torch's addcmul rounds `value * g` and fuses the rest,
//   so v = fma((1 - beta2) * g, g, v * beta2);
// - `p.mul_(1 - lr * wd)` then `p.add_(state1 / (state2.sqrt() + eps_hat), alpha=step_size)`: the division and the
//   sum round on their own, the step is another fused multiply-add; the square root is torch's own (at::sqrt, called
//   by the operator on the packed state: torch 2.13.0+cpu's fp32 sqrt is not the correctly rounded one, measured);
// - Lion: m' = fma(g, 1 - beta1, m * beta1), p = fma(sign(m'), -lr, p * decay) (exact product: p * decay - lr * sign),
//   m = fma(g, 1 - beta2, m * beta2); torch.sign gives 0 for NaN, as lion_sign;
// - SGD-momentum: g' = fma(p, wd, g) when wd > 0, m = g' at step 1 else m * beta1 + g', p = fma(m, -lr, p);
// - no element is skipped for a non-finite gradient (bnb's CPU update lets inf and NaN into the state);
// - DeepSpeed's unscale factor is applied as its `grad.mul_(factor)` does, in the gradient's own dtype.
// The hyper rows are the ieee ones (dsbnb::Hyper, LionHyper, MomentumHyper): bnb's Python computes the same constants
// in fp64 and torch rounds each to fp32 where an operation takes it. Whether torch's operations round this way on a
// machine (its fused multiply-add needs FMA hardware, its sqrt its own build) is checked against bnb itself before the
// kernel steps 32-bit state (deepspeed_bnb/optim/fused/route.py: kernel_arithmetic; ops/self_check.py).
// References: bitsandbytes 0.50.2 backends/cpu/ops.py (_optimizer_update_32bit_cpu); PyTorch
// aten/src/ATen/native/ufunc/add.h (fmadd), PointwiseOpsKernel.cpp (addcmul).
// Build and test: header-only, compiled into the CPU kernels (adam8bit_cpu.cpp, fused_cpu.h; std::fma needs no flag);
// pytest tests/kernels/test_bnb_cpu32.py.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>

#include "dsbnb/adam8bit.h"

namespace dsbnb {
namespace cpu {
namespace bnb32 {

// The gradient bnb's update reads: DeepSpeed's grad.mul_(factor) rounds the product to the gradient's dtype (bf16 and
// fp16 round to nearest even), and bnb widens it (fp32, bf16 and fp16 all convert to float exactly).
template <typename GradT, bool Scale>
inline float grad(GradT g, float inv_scale) {
    if (!Scale) return static_cast<float>(g);
    return static_cast<float>(static_cast<GradT>(static_cast<float>(g) * inv_scale));
}

// AdamW's moments (the operator then takes torch's sqrt of v).
inline void adam_moments(const Hyper& h, float m_old, float v_old, float g, float& m, float& v) {
    m = std::fma(g, h.one_minus_beta1, m_old * h.beta1);
    v = std::fma(h.one_minus_beta2 * g, g, v_old * h.beta2);
}

// AdamW's parameter from the new first moment and torch's square root of the new second one.
inline float adam_param(const Hyper& h, float p, float m, float root) {
    const float direction = m / (root + h.eps_hat);
    return std::fma(direction, h.step_size, p * h.decay);
}

inline void lion(const LionHyper& h, float p_old, float m_old, float g, float& p, float& m) {
    const float direction = std::fma(g, h.one_minus_beta1, m_old * h.beta1);
    p = std::fma(lion_sign(direction), -h.lr, p_old * h.decay);
    m = std::fma(g, h.one_minus_beta2, m_old * h.beta2);
}

inline void momentum(const MomentumHyper& h, float p_old, float m_old, float g, float& p, float& m) {
    const float decayed = h.weight_decay > 0.0f ? std::fma(p_old, h.weight_decay, g) : g;
    m = h.first != 0.0f ? decayed : m_old * h.beta1 + decayed;
    p = std::fma(m, -h.lr, p_old);
}

}  // namespace bnb32
}  // namespace cpu
}  // namespace dsbnb
