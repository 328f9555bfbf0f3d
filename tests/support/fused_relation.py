"""The fused kernel's documented relation to bitsandbytes' own update (optim/fused/contract.py): one fused step
against bnb's step from the same state. Held by tests/kernels/test_fused_contract.py on the CPU, and by the GPU proof's
engines part (tests/gpu/part_engines.py) on a GPU."""

from typing import List

import torch

BNB_CPU_TABLE_STEP = 2 / 65536  # bnb's CPU quantizer looks normalized values up in 65,536 cells over [-1, 1]


def fp32_one_minus(beta: float) -> float:
    """How far bnb's CUDA kernels' 1 - beta is from the exact one, relative: they form `1.0f - beta` in fp32 from the
    fp32-rounded beta (for beta2 = 0.999: 0.00099998713, 1.29e-5 below 0.001), where bnb's CPU path and the fused
    kernels form it in double and round once. Every second moment bnb's CUDA update adds is that much smaller."""
    exact = 1.0 - beta
    return abs(float(torch.tensor(1.0) - torch.tensor(beta)) - exact) / exact


def relation_breaks(mine: dict, bnbs: dict, w_mine, w_bnb, w_before, cuda_betas=None, w_rounding=0.0) -> List[str]:
    """One fused step against bnb's own step from the same state: each code within one quantization step of bnb's
    (the kernel rounds to the nearest code, bnb's CPU path through a look-up table, ties down, whose cells are
    coarser than the map's codes near 0: there the two may differ by up to one cell), each absmax within fp32 noise,
    the weights within 1% of the step they took. `cuda_betas`: the group's betas when bnb's step ran on CUDA, whose
    1 - beta is rounded in fp32 (fp32_one_minus): each absmax may then also differ by that rounding. `w_rounding`: how
    far apart one rounding of the stored weights may put them besides (compensated master weights: one error step).
    Returns what breaks it."""
    breaks = []
    for key, absmax, qmap in (("state1", "absmax1", "qmap1"), ("state2", "absmax2", "qmap2")):
        if key not in bnbs or bnbs[key].dtype != torch.uint8:
            continue
        qmap = bnbs[qmap]
        rank = torch.argsort(torch.argsort(qmap))  # a code's position among the map's sorted values
        steps = (rank[mine[key].long()] - rank[bnbs[key].long()]).abs()
        # bnb's CPU table cannot tell the map's smallest codes apart (0 and |u| < 3e-5 included)
        unresolved = (qmap[mine[key].long()] - qmap[bnbs[key].long()]).abs() <= BNB_CPU_TABLE_STEP
        # in a block whose absmax is 0 every code means 0 (bnb's CPU path stores code 0 there, the kernel 0.0's)
        scaled = (bnbs[absmax] > 0).repeat_interleave(256)[:steps.numel()]
        if ((steps > 1) & ~unresolved & scaled).any():
            breaks.append(f"{key} codes more than one step apart")
    for key, beta in zip(("absmax1", "absmax2"), cuda_betas or (None, None)):
        bar = 1e-5 + (fp32_one_minus(beta) if beta is not None else 0.0)
        if key in bnbs and not torch.allclose(mine[key], bnbs[key], rtol=bar, atol=0):
            apart = (mine[key] - bnbs[key]).abs() / bnbs[key].abs().clamp_min(torch.finfo(torch.float32).tiny)
            breaks.append(f"{key} differs (largest relative difference {float(apart.max()):.3g}, in "
                          f"{int((apart > bar).sum())} of {apart.numel()} blocks; bar {bar:.3g})")
    moved = (w_bnb - w_before).abs().max().item()
    if bool(((w_mine - w_bnb).abs() > 0.01 * moved + w_rounding).any()):
        breaks.append("weights off by more than 1% of the step" + (" and one rounding" if torch.is_tensor(w_rounding)
                                                                  or w_rounding else ""))
    return breaks
