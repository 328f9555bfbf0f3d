"""bitsandbytes' own 32-bit CPU update of one fp32-state segment, from a fused operator's hyper row: the pure-torch
reference of the "bnb_cpu" arithmetic's fp32 segments (csrc/cpu/bnb_cpu32.h is its compiled twin).

bnb 0.50's `_optimizer_update_32bit_cpu` is a sequence of torch operations with Python-float constants that bnb
computes in fp64 (1 - beta1, eps * sqrt(1 - beta2^t), -lr * sqrt(1 - beta2^t) / (1 - beta1^t), 1 - lr * wd); torch
rounds each to fp32 where an operation takes it, which is what the ieee hyper rows hold (reference.AdamHyper,
LionHyper, MomentumHyper). So the same operations with the rows' values give bnb's bits: torch's add with alpha
and its addcmul fuse a multiply-add, its sqrt is whatever this torch build computes, and no element is skipped for a
non-finite gradient. One difference from bnb's call, which changes no value: with a weight decay of 0 the weights are
multiplied by exactly 1.0 where bnb skips the multiplication. The operations are in place on views, as bnb's are; `g`
is the gradient bnb would read (DeepSpeed's unscale factor applied in the gradient's own dtype, then widened).
References: bitsandbytes 0.50.2 backends/cpu/ops.py (_optimizer_update_32bit_cpu).
Test: pytest tests/kernels/test_bnb_cpu32.py (against bitsandbytes itself and the compiled kernels).
"""

import torch


def adam(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """AdamW (bnb's "adam" rule, decoupled weight decay): p, m, v in place; h an AdamHyper row."""
    beta1, beta2, one_minus_beta1, one_minus_beta2, eps_hat, decay, step_size = h.tolist()
    m.mul_(beta1).add_(g, alpha=one_minus_beta1)
    v.mul_(beta2).addcmul_(g, g, value=one_minus_beta2)
    p.mul_(decay)
    p.add_(m / (v.sqrt() + eps_hat), alpha=step_size)


def lion(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """Lion: p and its momentum m in place; h a LionHyper row."""
    beta1, beta2, one_minus_beta1, one_minus_beta2, decay, lr = h.tolist()
    p.mul_(decay)
    p.add_(m.mul(beta1).add(g, alpha=one_minus_beta1).sign(), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=one_minus_beta2)


def momentum(p: torch.Tensor, m: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """SGD with momentum (coupled weight decay, m = g' at step 1): p and m in place; h a MomentumHyper row."""
    beta1, weight_decay, lr, first = h.tolist()
    decayed = g.add(p, alpha=weight_decay) if weight_decay > 0 else g
    if first:
        m.copy_(decayed)
    else:
        m.mul_(beta1).add_(decayed)
    p.add_(m, alpha=-lr)
