"""Whether the installed bitsandbytes has an optimizer update of its own on a device.

bitsandbytes before 0.50 (0.49.x, the release Axolotl pins) has no optimizer update on a CPU:
`functional.optimizer_update_8bit_blockwise` and `functional.optimizer_update_32bit` start with
`functional.is_on_gpu(...)`, which raises "All input tensors need to be on the same GPU, but found some tensors to not
be on a GPU" for CPU tensors (0.50 accepts CPU tensors there and registers CPU kernels for both). So on a CPU (a
CPU-only machine, or the CPU partitions of ZeRO-Offload) such a release can step only what the fused kernel steps;
fused/partition_step.py routes accordingly and refuses, by name, what nothing here can step.

The check probes that very function with a CPU tensor instead of comparing version numbers: it is the cause, and it
holds for any release that has it. GPUs are not probed: there bitsandbytes' CUDA kernels are its own update.
"""

import functools
import sys
from typing import Optional

import torch

FIRST_CPU_RELEASE = "0.50.0"  # the first bitsandbytes release with CPU optimizer updates (for messages)


@functools.lru_cache(maxsize=None)
def _cpu_refusal() -> Optional[str]:
    functional = sys.modules.get("bitsandbytes.functional")
    if functional is None:  # a bnb optimizer exists only once bitsandbytes is imported; nothing to step otherwise
        import bitsandbytes.functional as functional
    check = getattr(functional, "is_on_gpu", None)
    if check is None:
        return None
    try:
        check([torch.zeros(1)])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return (f"bitsandbytes {bnb_version()} has no optimizer update on a CPU: its functional.is_on_gpu refuses CPU "
                f"tensors ({first.rstrip(':')}); bitsandbytes {FIRST_CPU_RELEASE} added CPU updates")
    return None


def bnb_version() -> str:
    module = sys.modules.get("bitsandbytes")
    return getattr(module, "__version__", "?")


def missing(device) -> Optional[str]:
    """Why bitsandbytes' own `update_step` cannot run on `device` (None where it can, or `device` is None)."""
    if device is None or torch.device(device).type != "cpu":
        return None
    return _cpu_refusal()
