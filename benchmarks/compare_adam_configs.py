"""The optimizer configurations compare_adam.py runs, by name, with the labels its tables and plots use."""

LABELS = {
    "bnb8_fused": "bnb AdamW8bit, fused kernel",
    "bnb8_fallback": "bnb AdamW8bit, bnb's update",
    # the fused kernel with DeepSpeed's own conversion of each partition after the step (DEEPSPEED_BNB_KERNEL_LP_COPY=0)
    # where on the CPU the kernel writes the model's copy itself: the two side by side
    "bnb8_fused_ds_copy": "bnb AdamW8bit, fused kernel, DeepSpeed's copy",
    "torch_adamw": "torch AdamW (fp32)",
    "torch_adamw_fused": "torch AdamW(fused=True) (fp32)",
    "ds_adamw": "DeepSpeed Adam (fp32)",
    # bf16 models only (--bf16): the master weights each configuration keeps
    "ds_bf16_states": "DeepSpeed bf16 master + bf16 states (torch AdamW)",
    "bnb8_master_bf16": "bnb AdamW8bit, bf16 master",
    "bnb8_master_compensated": "bnb AdamW8bit, bf16+8 master",
}
CONFIGS = tuple(LABELS)
BF16_ONLY = ("ds_bf16_states", "bnb8_master_bf16", "bnb8_master_compensated")
DEFAULT = ("bnb8_fused", "bnb8_fallback", "torch_adamw", "ds_adamw")  # fp32 models
# bf16 models (--bf16): the least-memory question, each against fp32 master weights and states
DEFAULT_BF16 = ("torch_adamw", "ds_bf16_states", "bnb8_fused", "bnb8_master_bf16", "bnb8_master_compensated")
REFERENCE = "torch_adamw"  # ratios are taken against 32-bit torch AdamW (fp32 master weights and states)
