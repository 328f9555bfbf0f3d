"""Runs a fused 8-bit operator (AdamW, Lion, SGD with momentum) over some segments of one ZeRO partition.

The flat state is the one the segment-wise bnb path uses (bnb_adapter.py): `state1`/`state2` codes and
`absmax1`/`absmax2` over the partition, `fp32.state1`/`fp32.state2` for fp32-state parameters, `qmap1`/`qmap2`, and
the partition's `step`; so a checkpoint written by either path loads with the other, and one partition can mix
both (partition_step.py decides which segment goes where). Lion and SGD-momentum (bnb's Optimizer1State "lion" and
"momentum") have the first of each only. The hyper-parameter rows come from bnb's own per-parameter config
(`get_config` with overrides), so a learning-rate schedule or a per-parameter override reaches the kernel as it
reaches bnb. The arithmetic follows the device (route.kernel_arithmetic): on a CPU the reference's for 8-bit state and
bnb's own 32-bit CPU update for fp32 state (bnb_cpu, where that agrees with bnb here), on a GPU bnb's own.
On a GPU the rows travel from pinned host memory without blocking, so a step never waits for the device.
"""

import array
from typing import Optional, Sequence

import torch

from deepspeed_bnb.ops import rules
from deepspeed_bnb.optim.grad_mode import without_grad
from deepspeed_bnb.optim.state_classes import FP32_PREFIX
from deepspeed_bnb.state_layout import Segment


class FusedPartition:
    """The fused step of some segments of one partition (segment table built once, hyper rows every step)."""

    def __init__(self, rule: str, segments: Sequence[Segment], rows: Sequence[int], device, use_kernel: bool = True,
                 arithmetic: Optional[str] = None):
        self.update_rule = rules.get(rule)  # its registry entry; a ValueError for a rule without a fused kernel
        self.rule = rule  # bnb's rule name
        device = torch.device(device)
        self.table = rules.segment_table(segments, rows).to(device)  # rows: index into step()'s configs
        self.use_kernel = use_kernel  # False: the kernel's oracle (tests only)
        self.device = device
        # which rounding rules the kernel follows here (route.kernel_arithmetic; default: the device's)
        self.arithmetic = arithmetic or rules.arithmetic_for(device)
        self._empty = torch.zeros(0, device=device)
        self._empty_codes = torch.zeros(0, dtype=torch.uint8, device=device)
        self._no_map = torch.zeros(256, device=device)  # never read: no 8-bit segment
        # on a CPU, the hyper table's storage, rewritten every step (_cpu_hyper); None until the first step
        self._hyper_values: Optional[array.array] = None
        self._hyper: Optional[torch.Tensor] = None  # a float32 [H, fields] view of _hyper_values

    @without_grad
    def step(self, configs: Sequence[dict], step: int, params: torch.Tensor, grads: torch.Tensor, state: dict,
             inv_scale: Optional[torch.Tensor] = None, error: Optional[torch.Tensor] = None,
             lp_params: Optional[torch.Tensor] = None) -> None:
        """Update the segments in place at bnb step `step`, hyper row i from configs[i]; state["step"] is the
        caller's. `params`: fp32 or bf16 master weights, `error` the int8 error terms of compensated ones;
        `lp_params`: None, or the model's copy of fp32 ones that the kernel writes for the segments (on a GPU bf16)."""
        if not self.table.numel():
            return
        update = self.update_rule
        if self.device.type == "cpu":
            hyper = self._cpu_hyper(update.row_objects(configs, step, self.arithmetic))
        else:
            hyper = update.rows(configs, step, self.arithmetic)
            # on a GPU a fresh pinned buffer: the caching host allocator keeps it until the copy ran
            hyper = (hyper.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda"
                     else hyper.to(self.device))
        # bnb's keys per moment k: codes "state<k>", "absmax<k>", fp32 state FP32_PREFIX + "state<k>", map "qmap<k>"
        # (a partition without 8-bit parameters has no codes, scales or maps)
        moments = range(1, update.moments + 1)
        rules.step_(update, params, grads, [state.get(f"state{k}", self._empty_codes) for k in moments],
                    [state.get(f"absmax{k}", self._empty) for k in moments],
                    [state.get(f"{FP32_PREFIX}state{k}", self._empty) for k in moments],
                    [state.get(f"qmap{k}", self._no_map) for k in moments], self.table, hyper, inv_scale, error,
                    self.arithmetic, lp_params, use_kernel=self.use_kernel)

    def _cpu_hyper(self, rows: Sequence) -> torch.Tensor:
        """The hyper table of `rows`, written into this partition's own storage: the kernel reads it during the call and
        keeps nothing, so one table serves every step, where a new tensor per step measured ~25 us inside a training
        step (cold caches). array('f') rounds each Python float to float32 to nearest, as rules.hyper_table's
        torch.tensor(..., dtype=float32) does: the same bits (tests/kernels/test_fused_contract.py)."""
        values = array.array("f", [v for row in rows for v in row.row()])
        if self._hyper_values is None or len(self._hyper_values) != len(values):
            self._hyper_values = values
            self._hyper = torch.frombuffer(values, dtype=torch.float32).reshape(len(rows), -1)
        else:
            self._hyper_values[:] = values  # same length: the view stays valid
        return self._hyper
