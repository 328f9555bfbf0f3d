"""Shape-only (fake) implementations of deepspeed_bnb's operators, for torch.compile / opcheck tracing: one per
operator (ops/build_flags.py lists them), registered by the loader once it has loaded the compiled ones."""

from typing import Iterable

import torch


def _updates_in_place(*args):
    return None  # every operator updates its arguments in place: nothing to allocate


def register(operators: Iterable[str]) -> None:
    """Register the shape-only implementation of each operator (deepspeed_bnb::<name>)."""
    for name in operators:
        torch.library.register_fake(f"deepspeed_bnb::{name}", _updates_in_place)
