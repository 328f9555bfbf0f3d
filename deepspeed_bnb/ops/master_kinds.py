"""The master weights a fused kernel steps, by the names `zero_optimization.bnb_master_weights` and checkpoints use:
fp32; bf16; and bf16 compensated by an int8 rounding error (csrc/include/dsbnb/master_weights.h: MasterKind; the
pure-torch reference: ops/reference.py with ops/compensated.py). The one list of them: optim/master_weights.py (what a
run keeps, and "auto"), the config's validation and the first-use check read it from here."""

FP32, BF16, COMPENSATED = "fp32", "bf16", "bf16+8"
MODES = (FP32, BF16, COMPENSATED)
