"""The optimizer configurations compare_adam.py runs, by name, with the labels its tables and plots use."""

LABELS = {
    "bnb8_fused": "bnb AdamW8bit, fused kernel",
    "bnb8_fallback": "bnb AdamW8bit, bnb's update",
    "torch_adamw": "torch AdamW (fp32)",
    "ds_adamw": "DeepSpeed Adam (fp32)",
}
CONFIGS = tuple(LABELS)
REFERENCE = "torch_adamw"  # ratios are taken against 32-bit torch AdamW
