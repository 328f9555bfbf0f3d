"""What BnbZeroOptimizer needs from DeepSpeed's ZeRO-1/2 optimizer that not every DeepSpeed release has.

DeepSpeed 0.19.7 added per-parameter padding inside ZeRO-1/2 flat groups (`zero_optimization.parameter_alignment`):
`flatten_dense_tensors_aligned(..., param_padding=...)`, the `round_robin_bit16_padding` / `round_robin_bit16_offsets`
lists, and their use in gradient partitioning, offload, the links to the fp32 partition and checkpoints. The
block-aligned layout of bitsandbytes state is chosen through exactly that padding. Releases before it (0.19.0-0.19.6,
0.18.x) keep parameters contiguous in all those places, so supporting them would mean copying those DeepSpeed
functions; they are refused here with the reason, even under DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS=1.

Between the supported releases:
- DeepSpeed 0.19.8 copies gradients into the ZeRO-Offload CPU buffers asynchronously and waits for those copies
  before loading a checkpoint (`_wait_for_offload_copies`); 0.19.7 copies synchronously.
- DeepSpeed 0.19.7 does not average gradients across ranks under ZeRO-1 with a separate fp32 gradient accumulator
  (`use_grad_accum_attribute`: bf16/fp16 with data_types.grad_accum_dtype "fp32", a combination deepspeed_bnb routes
  to DeepSpeedZeroOptimizer): `get_gradient_for_reduction` returns `param.grad_accum.to(self.dtype)`, a copy, so the
  reduced values land in the copy and the step reads the rank's own `grad_accum`. 0.19.8 reduces `grad_accum` itself.
  Stock DeepSpeedZeroOptimizer with torch.optim.AdamW shows the same divergence at DP=2, so it is refused here.
"""

import inspect

import deepspeed
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from packaging.version import Version

from deepspeed_bnb._versions import listed

PARAMETER_PADDING_SINCE = "0.19.7"


def has_parameter_padding(zero_optimizer_class=DeepSpeedZeroOptimizer) -> bool:
    return "param_padding" in inspect.signature(zero_optimizer_class.flatten_dense_tensors_aligned).parameters


def require_parameter_padding(zero_optimizer_class=DeepSpeedZeroOptimizer) -> None:
    if not has_parameter_padding(zero_optimizer_class):
        raise RuntimeError(
            f"deepspeed_bnb: DeepSpeed {deepspeed.__version__} has no per-parameter padding in ZeRO-1/2 flat groups "
            f"(DeepSpeed {PARAMETER_PADDING_SINCE} added it: flatten_dense_tensors_aligned(param_padding=...)), and "
            f"the block-aligned layout of bitsandbytes state is built on it. Install DeepSpeed "
            f"{listed('deepspeed', 'or')} (the releases deepspeed_bnb is tested with).")


def wait_for_offload_copies(zero_optimizer) -> None:
    """Let pending gradient copies to the offload buffers finish before a load overwrites state (0.19.8 and later)."""
    wait = getattr(zero_optimizer, "_wait_for_offload_copies", None)
    if wait is not None:  # DeepSpeed 0.19.7 has no asynchronous copies to wait for
        wait()


def reduces_grad_accum(deepspeed_version: str = deepspeed.__version__) -> bool:
    """Whether DeepSpeed averages a separate fp32 gradient accumulator across ranks (0.19.8 on; see above)."""
    return Version(Version(deepspeed_version).base_version) >= Version("0.19.8")


def require_reduced_grad_accum(use_grad_accum_attribute: bool, dp_world_size: int,
                               deepspeed_version: str = deepspeed.__version__) -> None:
    """Refuse ZeRO-1 with a separate fp32 gradient accumulator on more than one rank where DeepSpeed would not
    average it (DeepSpeed 0.19.7, see the module docstring); one rank has nothing to average."""
    if use_grad_accum_attribute and dp_world_size > 1 and not reduces_grad_accum(deepspeed_version):
        raise NotImplementedError(
            f"deepspeed_bnb: DeepSpeed {deepspeed_version} does not average gradients across data-parallel ranks "
            f"under ZeRO stage 1 with fp32 gradient accumulation (data_types.grad_accum_dtype \"fp32\" with bf16 or "
            f"fp16): it reduces a copy of each accumulated gradient and steps with the unreduced one (fixed in "
            f"DeepSpeed 0.19.8). Install DeepSpeed 0.19.8, or use zero_optimization.stage 2, or drop "
            f"data_types.grad_accum_dtype.")
