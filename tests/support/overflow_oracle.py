"""DeepSpeed's own inf/NaN check before a ZeRO-1/2 step, called on given gradient pieces: the oracle of
deepspeed_bnb's batched check (tests/unit/test_overflow_check.py, and the GPU proof's part s on the device)."""

import types


def deepspeeds_answer(groups) -> bool:
    """DeepSpeed's has_overflow_partitioned_grads_serial (the installed release's) on param groups of gradient pieces
    (lists of tensors or None), through an object holding just what it reads."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    holder = types.SimpleNamespace(bit16_groups=groups, averaged_gradients=dict(enumerate(groups)),
                                   _has_inf_or_nan=DeepSpeedZeroOptimizer._has_inf_or_nan)
    return bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(holder))
