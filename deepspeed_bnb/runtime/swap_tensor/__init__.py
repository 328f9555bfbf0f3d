"""Overrides of deepspeed.runtime.swap_tensor: NVMe swapping of bitsandbytes optimizer state."""
