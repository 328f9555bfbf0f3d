"""Operators on blockwise 8-bit optimizer state: the registry of fused update rules (rules.py), their compiled kernels
(loader.py) and the pure-torch reference that defines them (reference.py)."""
