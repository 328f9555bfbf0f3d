"""The `zero_optimization.bnb_*` config keys, added to DeepSpeed's own pydantic ZeRO config model.

DeepSpeed's `DeepSpeedZeroConfig` forbids unknown keys (pydantic `extra="forbid"`), and HF Trainer / Accelerate build
`DeepSpeedConfig` themselves, long before `deepspeed.initialize`. Stripping our keys inside `initialize` is therefore
not enough: the model itself must know them. The subclass below replaces DeepSpeed's where `get_zero_config` looks it
up (overrides.py), so every parser accepts the new keys and still rejects typos such as `bnb_keep_hole`.
"""

from dataclasses import dataclass
from typing import List, Tuple, Union

import deepspeed.runtime.zero.config as ds_zero_config
from pydantic import Field, field_validator

from deepspeed_bnb.optim import master_weights
from deepspeed_bnb.optim.fused.route import FusedKernel
from deepspeed_bnb.state_layout import BLOCK_SIZE

DEFAULT_KEEP_WHOLE = ("qmap1", "qmap2")


class BnbZeroConfig(ds_zero_config.DeepSpeedZeroConfig):
    """DeepSpeed's ZeRO config plus the deepspeed_bnb keys (all optional; stock keys behave as before)."""

    bnb_keep_whole: List[str] = Field(default_factory=lambda: list(DEFAULT_KEEP_WHOLE))
    """
    Optimizer-state keys (exact names) that stay whole: replicated on every rank, never sharded, trimmed,
    concatenated or re-split. bitsandbytes' quantization maps `qmap1`/`qmap2` are whole whatever this says (the
    state registry knows them); list here the extra keys of a custom bnb optimizer that are the same for every
    parameter.
    """

    bnb_keep_whole_threshold: int = BLOCK_SIZE
    """
    A state tensor of unknown key with at most this many elements that is neither one value per parameter element
    nor one per 256-element block stays whole. 0 disables the rule (unknown small keys then raise an error).
    """

    bnb_fused_kernel: Union[bool, str] = "auto"
    """
    Step bnb optimizers with deepspeed_bnb's fused kernels where they compute bnb's own update (one pass per
    partition: unscale/clip, update, requantization; C++ on CPU, CUDA on GPU), bnb's own update elsewhere:
    "auto" (default): the kernel for each parameter the contract allows (8-bit state, bnb's own update_step, every
    config field modelled: optim/fused/contract.py), on CPUs and GPUs. When the kernel cannot run here (no compiler,
    or a build that fails its first-use check against its oracle on the device, ops/self_check.py), bnb's own update
    steps instead, after one warning.
    true: the same per-parameter contract, but the kernel must run: an error where it cannot.
    false: bnb's own update everywhere. Checkpoints load either way.
    """

    bnb_master_weights: str = master_weights.AUTO
    """
    The master weights ZeRO keeps for a bnb optimizer: "fp32" (4 bytes per parameter), "bf16" (2 bytes; DeepSpeed's
    bf16.bf16_master_weights_and_grads, which "auto" follows), or "bf16+8" (3 bytes: bf16 plus an 8-bit rounding error,
    a 24-bit master weight). "bf16" and "bf16+8" need bf16 model weights. optim/master_weights.py.
    """

    bnb_convert_stock_on_load: bool = False
    """
    Load a stock DeepSpeed checkpoint's optimizer state (a run of torch's AdamW or of a bitsandbytes Adam under
    DeepSpeed without deepspeed_bnb) by converting it at `load_checkpoint`: rewritten once into a deepspeed_bnb tag
    beside it, loaded, and removed (runtime/converted_load.py). 8-bit moments are requantized (within half a
    quantization step; the load prints the worst case). false (default): such a load is refused, naming
    `deepspeed-bnb convert`.
    """

    @field_validator("bnb_master_weights", mode="before")
    @classmethod
    def _master_weights_is_a_mode(cls, value):
        return master_weights.check_setting(value)

    @field_validator("bnb_fused_kernel", mode="before")
    @classmethod
    def _fused_is_auto_or_bool(cls, value):
        FusedKernel.of(value)  # the parsed setting is BnbSettings'; the config keeps what the user wrote
        return value

    @field_validator("bnb_keep_whole", mode="before")
    @classmethod
    def _keep_whole_is_list_of_names(cls, value):
        if not isinstance(value, (list, tuple)) or not all(isinstance(k, str) and k for k in value):
            raise ValueError(f"zero_optimization.bnb_keep_whole must be a list of optimizer-state key names "
                             f"(non-empty strings), e.g. {list(DEFAULT_KEEP_WHOLE)}; got {value!r}")
        return list(value)

    @field_validator("bnb_convert_stock_on_load", mode="before")
    @classmethod
    def _convert_is_bool(cls, value):
        if not isinstance(value, bool):  # pydantic would read "no" or 0 as a choice: a typo must not pick one
            raise ValueError(f"zero_optimization.bnb_convert_stock_on_load must be true or false (JSON booleans); "
                             f"got {value!r}")
        return value

    @field_validator("bnb_keep_whole_threshold", mode="before")
    @classmethod
    def _threshold_is_count(cls, value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"zero_optimization.bnb_keep_whole_threshold must be a non-negative integer "
                             f"(a number of elements, default {BLOCK_SIZE}); got {value!r}")
        return value


@dataclass(frozen=True)
class BnbSettings:
    """The deepspeed_bnb keys of one engine's ZeRO config, read once (`of`) and handed to its ZeRO optimizer."""

    keep_whole: Tuple[str, ...] = DEFAULT_KEEP_WHOLE  # bnb_keep_whole: state keys replicated whole
    keep_whole_threshold: int = BLOCK_SIZE  # bnb_keep_whole_threshold: small unknown keys kept whole
    fused_kernel: FusedKernel = FusedKernel.AUTO  # bnb_fused_kernel, parsed
    master_weights: str = master_weights.AUTO  # bnb_master_weights: "auto" or one of master_weights.MODES
    convert_stock_on_load: bool = False  # bnb_convert_stock_on_load: stock tags converted at load_checkpoint

    @classmethod
    def of(cls, zero_config) -> "BnbSettings":
        """The settings of a parsed ZeRO config (the defaults where it was parsed before deepspeed_bnb was imported,
        and so lacks the keys)."""
        return cls(keep_whole=tuple(getattr(zero_config, "bnb_keep_whole", DEFAULT_KEEP_WHOLE)),
                   keep_whole_threshold=getattr(zero_config, "bnb_keep_whole_threshold", BLOCK_SIZE),
                   fused_kernel=FusedKernel.of(getattr(zero_config, "bnb_fused_kernel", "auto")),
                   master_weights=master_weights.check_setting(getattr(zero_config, "bnb_master_weights",
                                                                        master_weights.AUTO)),
                   convert_stock_on_load=bool(getattr(zero_config, "bnb_convert_stock_on_load", False)))
