"""A flat partition stepped in bitsandbytes' own CUDA arithmetic: the fused kernels against bnb's own update.

`BnbPartition` is a random partition of one rule (8-bit and 32-bit segments, block tails, three hyper rows from the
bnb-style param groups of support.kernel_harness, NaN, Inf, huge and tiny gradients, an all-zero block) with fp32,
bf16 or compensated master weights; `differences` lists where two of them differ, bit for bit. Used by
tests/kernels/test_fused_bnb_cuda.py (the product's kernels) and the GPU proof's launch-shape part (its variants).
"""

import torch

from deepspeed_bnb.ops import compensated, rules
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.state_layout import GroupLayout
from support.kernel_harness import BNB_CUDA_CONFIGS as CONFIGS, QMAPS


class BnbPartition:
    """A flat partition of `numels` parameters (8-bit where `eight_bit`) on `device`, rank `rank` of `dp`, its state
    from zero (random_start: from random codes, scales and fp32 state, as after some steps)."""

    def __init__(self, rule: str, seed: int, device, numels=None, eight_bit=None, master="fp32", dp=3, rank=1,
                 random_start=False):
        g = torch.Generator().manual_seed(seed)
        if numels is None:
            count = int(torch.randint(2, 7, (1,), generator=g))
            numels = tuple(int(n) for n in torch.randint(1, 5000, (count,), generator=g))
            eight_bit = [bool(b) for b in torch.rand(count, generator=g) < 0.7]
        if rule == "momentum" and master == "bf16":  # bnb has no bf16 entry to its 32-bit momentum kernel
            eight_bit = [True] * len(numels)
        layout = GroupLayout(tuple(numels), dp)
        self.rule, self.device, self.generator = rule, device, g
        self.moments = rules.get(rule).moments
        self.segments = layout.segments(rank, eight_bit)
        rows = [int(r) for r in torch.randint(0, 3, (len(self.segments),), generator=g)]
        self.table = rules.segment_table(self.segments, rows).to(device)
        size, fp32 = layout.partition_size, layout.fp32_numel(rank, eight_bit)
        weights = torch.randn(size, generator=g)
        self.error = None
        if master == "bf16":
            self.params = weights.to(torch.bfloat16)
        elif master == "bf16+8":
            self.params, self.error = compensated.split(weights)
        else:
            self.params = weights
        self.grad_dtype = torch.float32 if master == "fp32" else torch.bfloat16
        self.codes = [torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8) if random_start else
                      torch.zeros(size, dtype=torch.uint8) for _ in range(self.moments)]
        self.absmax = [torch.rand(size // 256, generator=g) * 1e-2 if random_start else torch.zeros(size // 256)
                       for _ in range(self.moments)]
        self.state = [(torch.randn(fp32, generator=g) * 1e-3).abs() if random_start else torch.zeros(fp32)
                      for _ in range(self.moments)]
        self.qmaps = [q.clone() for q in QMAPS[:self.moments]]
        self._to(device)

    def _to(self, device):
        for name in ("params", "error"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        for name in ("codes", "absmax", "state", "qmaps"):
            setattr(self, name, [t.to(device) for t in getattr(self, name)])

    def clone(self) -> "BnbPartition":
        other = object.__new__(BnbPartition)
        other.__dict__.update(self.__dict__)
        other.params = self.params.clone()
        other.error = None if self.error is None else self.error.clone()
        for name in ("codes", "absmax", "state"):
            setattr(other, name, [t.clone() for t in getattr(self, name)])
        return other

    def grads(self, step: int) -> torch.Tensor:
        g = self.generator
        grads = torch.randn(self.params.numel(), generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g))
        grads[:300] = 0.0  # an all-zero block (and a zero stretch)
        if step % 3 == 1:
            grads[torch.randint(0, grads.numel(), (5,), generator=g)] = float("nan")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = float("inf")
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 3e19  # g * g overflows fp32
            grads[torch.randint(0, grads.numel(), (3,), generator=g)] = 1e-30
        return grads.to(self.grad_dtype).to(self.device)

    def step(self, step: int, grads: torch.Tensor, use_kernel: bool, inv_scale=None, arithmetic=rules.BNB_CUDA,
             lp_params=None):
        hyper = rules.get(self.rule).rows(CONFIGS[self.rule], step, arithmetic).to(self.device)
        rules.step_(self.rule, self.params, grads, self.codes, self.absmax, self.state, self.qmaps, self.table, hyper,
                    inv_scale, self.error, arithmetic, lp_params, use_kernel=use_kernel)

    def tensors(self) -> dict:
        named = {"params": self.params, **({"error": self.error} if self.error is not None else {})}
        for k in range(self.moments):
            named.update({f"codes{k + 1}": self.codes[k], f"absmax{k + 1}": self.absmax[k],
                          f"state{k + 1}": self.state[k]})
        return named


def differences(a: BnbPartition, b: BnbPartition) -> list:
    found = []
    for (name, x), y in zip(a.tensors().items(), b.tensors().values()):
        x, y = bits(x.cpu()), bits(y.cpu())
        if not torch.equal(x, y):
            where = (x != y).nonzero().flatten()[:5].tolist()
            found.append(f"{name} at {where} (of {int((x != y).sum())}): {[x[i].item() for i in where]} vs "
                         f"{[y[i].item() for i in where]}")
    return found
