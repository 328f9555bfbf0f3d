"""Keeps a bitsandbytes optimizer under ZeRO-Offload when Accelerate prepares it for DeepSpeed (Accelerate 1.x).

`Accelerator._prepare_deepspeed` replaces any client optimizer with `map_pytorch_optim_to_deepspeed(optimizer)`, a
DeepSpeedCPUAdam with fp32 state that keeps only `lr` and `weight_decay`, whenever the DeepSpeed config offloads the
optimizer and does not say `"zero_force_ds_cpu_optimizer": false` (a missing key counts as true there). For a bnb
optimizer that silently drops the 8-bit state, betas and eps, and turns 8-bit AdamW into Adam with L2 weight decay
(`adamw_mode` is true only for 32-bit bnb AdamW). DeepSpeed itself takes a client optimizer
under offload exactly when that key is false, so for a bnb optimizer with the key absent we set it to false in the
config Accelerate is about to hand to DeepSpeed (Accelerate sets `zero_allow_untested_optimizer` in the same dict),
with a log line. A config that says true explicitly is left alone, and a warning says what Accelerate will do.
HF Trainer prepares its optimizer through the same method, so `optim="adamw_bnb_8bit"` is covered too.
"""

import os
import warnings

from deepspeed import comm as dist
from deepspeed.runtime.constants import ZERO_FORCE_DS_CPU_OPTIMIZER
from deepspeed.utils import logger

from deepspeed_bnb.optim.bnb_adapter import is_bnb_optimizer
from deepspeed_bnb.installer import stock


def _first_rank() -> bool:
    """Whether this process is rank 0. Accelerate may prepare before DeepSpeed's comm exists (HF Trainer on CPU
    ranks does), where DeepSpeed's log_dist would let every rank speak: the launcher's RANK says then."""
    return (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0


def keep_bnb_under_offload(config: dict, prepared) -> str:
    """Adjust Accelerate's DeepSpeed `config` for the objects being prepared; return what was done (for tests)."""
    optimizer = next((obj for obj in prepared if is_bnb_optimizer(obj)), None)
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if optimizer is None or offload.get("device", "none") == "none":  # Accelerate's own test for swapping
        return "untouched"
    name = type(optimizer).__name__
    if ZERO_FORCE_DS_CPU_OPTIMIZER not in config:
        config[ZERO_FORCE_DS_CPU_OPTIMIZER] = False
        if _first_rank():  # a warning: DeepSpeed's logger hides INFO by default, and a changed config is news
            logger.warning(f"deepspeed_bnb: keeping {name} under offload_optimizer (set "
                           f"\"{ZERO_FORCE_DS_CPU_OPTIMIZER}\": false, which Accelerate needs not to replace it "
                           "with DeepSpeedCPUAdam)")
        return "kept"
    if config[ZERO_FORCE_DS_CPU_OPTIMIZER]:
        warnings.warn(f"deepspeed_bnb: the DeepSpeed config says \"{ZERO_FORCE_DS_CPU_OPTIMIZER}\": true with "
                      f"offload_optimizer, so Accelerate replaces {name} with DeepSpeedCPUAdam (32-bit state; only "
                      "lr and weight_decay carried over; 8-bit AdamW becomes Adam with L2 weight decay). Set "
                      "\"zero_force_ds_cpu_optimizer\": false to keep the bitsandbytes optimizer.", RuntimeWarning,
                      stacklevel=4)  # the caller of prepare()
        return "swapped"
    return "kept"


def _prepare_deepspeed(self, *args):
    keep_bnb_under_offload(self.deepspeed_plugin.deepspeed_config, args)
    return stock("Accelerator._prepare_deepspeed")(self, *args)
