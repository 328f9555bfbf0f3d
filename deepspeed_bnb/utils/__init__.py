"""Overrides of deepspeed.utils, at the same module paths (tensor_fragment); and teardown, how every multi-rank launch
of the repository ends and is judged."""
