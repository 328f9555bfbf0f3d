"""Overrides of deepspeed.utils, at the same module paths."""
