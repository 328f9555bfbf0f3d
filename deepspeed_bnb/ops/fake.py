"""Shape-only (fake) implementations of deepspeed_bnb's operators, for torch.compile / opcheck tracing: one per
operator of the rule registry (ops/rules.py)."""

import torch

from deepspeed_bnb.ops import rules


def _updates_in_place(*args):
    return None  # every operator updates its arguments in place: nothing to allocate


for _rule in rules.RULES.values():
    torch.library.register_fake(f"deepspeed_bnb::{_rule.operator}", _updates_in_place)
