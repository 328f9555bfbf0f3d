"""Which master weights a bnb ZeRO optimizer keeps: fp32, bf16, or bf16 with an 8-bit compensation term.

DeepSpeed 0.19.8 keeps ZeRO's master partition in bf16 when `bf16.bf16_master_weights_and_grads` is true, but only
with DeepSpeedCPUAdam on CPU offload, or with `bf16_optimizer_states` (bf16 Adam moments): its fp32 moments would
otherwise cost more than the master weights save (the assertion in `ZeROOptimizer._configure_master_weights`,
runtime/base_optimizer.py). bitsandbytes' state is 8-bit and its update steps bf16 parameters itself, so for a bnb
optimizer that reason does not hold: DeepSpeed's key is honoured at every stage, with and without offload.

`zero_optimization.bnb_master_weights` says it explicitly and adds the compensated mode:
- "fp32": fp32 master weights (DeepSpeed's default);
- "bf16": bf16 master weights, DeepSpeed's `bf16_master_weights_and_grads`: 2 bytes per parameter instead of 4, but
  an update smaller than half a bf16 ulp of its weight (about 2^-8 of it) is lost;
- "bf16+8": bf16 master weights plus one int8 per parameter holding the rounding error in 1/256 ulp steps (a 24-bit
  master weight, 3 bytes): ops/compensated.py;
- "auto" (default): "bf16" where DeepSpeed's key asks for it and the trainable weights are bf16, else "fp32" (fp32
  adapters on a frozen bf16 base keep fp32 master weights; a mix of bf16 and fp32 trainable weights under the key is
  refused: one ZeRO optimizer keeps one master dtype).
"""

from dataclasses import dataclass
from typing import Collection

import torch

from deepspeed_bnb.ops.master_kinds import BF16, COMPENSATED, FP32, MODES  # noqa: F401  (MODES: this module's API)
# what converting fp32 master weights to each mode loses (bf16: round to nearest even, half an ulp at most)
LOSS = {FP32: "nothing", BF16: "up to 2^-9 of each weight", COMPENSATED: "up to 2^-16 of each weight"}
AUTO = "auto"
KEY = "zero_optimization.bnb_master_weights"
DS_KEY = "bf16.bf16_master_weights_and_grads"


def check_mode(mode: str, where: str) -> str:
    """`mode` if it is one of MODES; else a ValueError naming `where` (the key or option) and the choices."""
    if mode not in MODES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, MODES))}; got {mode!r}")
    return mode


def check_setting(setting: str, where: str = KEY) -> str:
    """`setting` if it is "auto" or one of MODES (what bnb_master_weights may say); else a ValueError naming `where`."""
    if setting not in (AUTO,) + MODES:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, (AUTO,) + MODES))}; got {setting!r}")
    return setting


def representable(weights: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 `weights` as master weights of `mode` hold them, widened to fp32 again: unchanged for fp32, rounded to
    nearest-even bf16 for bf16, to the nearest 1/256-ulp step for bf16+8 (exact for values that came from that mode)."""
    from deepspeed_bnb.ops import compensated  # pure torch; imported here to keep this module's imports light
    if mode == BF16:
        return compensated.to_bf16(weights.float()).float()
    if mode == COMPENSATED:
        return compensated.join(*compensated.split(weights.float()))
    return weights.float()


@dataclass(frozen=True)
class MasterWeights:
    """The master weights of one run."""

    mode: str  # FP32, BF16 or COMPENSATED (what checkpoints record)
    dtype: torch.dtype  # dtype of ZeRO's master partition (and of its gradient partition): fp32 or bf16

    @property
    def compensated(self) -> bool:
        """Whether an int8 error term per element completes the bf16 partition."""
        return self.mode == COMPENSATED


def resolve(setting: str, ds_bf16_master: bool, dtypes: Collection[torch.dtype]) -> MasterWeights:
    """The master weights of a run from `bnb_master_weights` (`setting`), DeepSpeed's `bf16_master_weights_and_grads`
    and the dtypes of the trainable weights; a ValueError naming the keys where they disagree.

    "auto" under DeepSpeed's key follows the trainable weights' dtype: bf16 weights get bf16 master weights, fp32
    ones fp32 (fp32 adapters on a frozen bf16 base, as PEFT keeps LoRA weights under DeepSpeed's torch_autocast:
    bf16 master weights would round every fp32 adapter weight to bf16 at the first step). A mix of both would need
    master weights of two dtypes in one ZeRO optimizer, which is refused with the fixes that work."""
    check_setting(setting)
    dtypes = set(dtypes) or {torch.float32}
    if setting == AUTO and ds_bf16_master and len(dtypes) > 1:
        raise ValueError(f"{DS_KEY}: true asks for bf16 master weights, but the trainable weights are of several "
                         f"dtypes ({', '.join(sorted(map(str, dtypes)))}), and one ZeRO optimizer keeps one master "
                         f"dtype. Cast the trainable weights to one dtype (bf16: bf16 master weights; fp32: fp32), "
                         f"or set {DS_KEY} to false (fp32 master weights for all).")
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else None
    mode = (BF16 if ds_bf16_master and dtype == torch.bfloat16 else FP32) if setting == AUTO else setting
    if mode == FP32 and ds_bf16_master and setting != AUTO:
        raise ValueError(f"{KEY}: \"fp32\" contradicts {DS_KEY}: true. Remove one of the two (\"bf16\" or \"bf16+8\" "
                         f"keep bf16 master weights).")
    if mode != FP32 and dtype != torch.bfloat16:
        raise ValueError(f"{KEY}: {mode!r} keeps bf16 master weights, which needs bf16 trainable weights; they are "
                         f"{', '.join(sorted(map(str, dtypes)))}. Enable bf16 (\"bf16\": {{\"enabled\": true}}) so "
                         f"DeepSpeed casts the model, or remove {KEY} (\"auto\" keeps fp32 master weights for fp32 "
                         f"weights).")
    return MasterWeights(mode=mode, dtype=torch.float32 if mode == FP32 else torch.bfloat16)
