"""Public names of a bitsandbytes optimizer's per-element state: bnb's own keys and torch's names for the same moments.

bitsandbytes calls its moments `state1` / `state2` whatever the update rule; torch's optimizers (and DeepSpeed's
FusedAdam, DeepSpeedCPUAdam, FusedLamb, FusedLion, which follow them) name each moment after what it is. Both sets
of names reach the same fp32 values: `export` writes them into `optimizer.safetensors`, and DeepSpeed's
`safe_{get,set}_{full,local}_optimizer_state` accept them (utils/tensor_fragment.py).
"""

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

ROW_NAMES: Dict[str, Dict[str, Tuple[str, ...]]] = {
    # bnb update rule (Optimizer8bit.optimizer_name) -> bnb state key -> torch's name of each of its rows. A key
    # with one name has no leading rows; AdEMAMix's state1 holds two (fast EMA, slow EMA), one name each.
    "adam": {"state1": ("exp_avg",), "state2": ("exp_avg_sq",)},  # torch Adam/AdamW, DeepSpeed FusedAdam
    "lamb": {"state1": ("exp_avg",), "state2": ("exp_avg_sq",)},  # DeepSpeed FusedLamb
    "ademamix": {"state1": ("exp_avg", "exp_avg_slow"), "state2": ("exp_avg_sq",)},
    "lion": {"state1": ("exp_avg",)},  # DeepSpeed FusedLion / DeepSpeedCPULion call Lion's momentum exp_avg
    # m = beta * m + g is a running sum, not an average: torch.optim.SGD's name, not exp_avg
    "momentum": {"state1": ("momentum_buffer",)},
    "lars": {"state1": ("momentum_buffer",)},
    "rmsprop": {"state1": ("square_avg",)},  # torch.optim.RMSprop
    "adagrad": {"state1": ("sum",)},  # torch.optim.Adagrad
}

TORCH_NAMES: Dict[str, Tuple[str, ...]] = {  # bnb update rule -> torch's names, state1 rows then state2
    rule: tuple(name for names in keys.values() for name in names) for rule, keys in ROW_NAMES.items()}
# bnb update rules whose state is exactly torch Adam's two moments (exp_avg, exp_avg_sq): what `convert` can hand
# between Adam-family optimizers; of them, those whose update also needs a per-tensor trust ratio (LAMB), which a
# torch AdamW (a universal checkpoint's reader) would not apply
ADAM_STATE_RULES = tuple(rule for rule, names in TORCH_NAMES.items() if names == ("exp_avg", "exp_avg_sq"))
TRUST_RATIO_RULES = ("lamb",)
# every torch name of a moment some rule keeps: what tells a torch optimizer's state of one rule from another's
ALL_TORCH_NAMES = frozenset(name for names in TORCH_NAMES.values() for name in names)


# a rule's per-element state as `convert` reads and writes it: each bnb key in order with torch's names of its rows
KeyRows = Tuple[Tuple[str, Tuple[str, ...]], ...]


def key_rows(rule: str) -> Optional[KeyRows]:
    """`rule`'s bnb keys (state1, then state2) with torch's names of their rows, e.g. AdEMAMix's
    (("state1", ("exp_avg", "exp_avg_slow")), ("state2", ("exp_avg_sq",))); None for a rule not known here."""
    keys = ROW_NAMES.get(rule)
    return tuple(keys.items()) if keys else None


def row_names(rows: KeyRows) -> Tuple[str, ...]:
    """torch's names of every row of `rows`, in order (state1's rows, then state2's): TORCH_NAMES of its rule."""
    return tuple(name for _, names in rows for name in names)


ADAM_ROWS: KeyRows = key_rows("adam")  # Adam's two moments, one row each: what convert reads unless told


@dataclass(frozen=True)
class StateName:
    """Where one public state name lives in bnb's state."""

    key: str  # bnb's per-element state key (state1, state2, ...)
    row: Optional[int]  # the row of that key's leading dimension (AdEMAMix's state1), or None: the whole key


def public_names(rule: str, element_rows: Mapping[str, int]) -> Dict[str, StateName]:
    """Every name that reaches a per-element state: bnb's keys themselves, then torch's names for them.

    `element_rows`: bnb's per-element keys for one parameter -> their number of leading rows (0: none).
    """
    names = {key: StateName(key, None) for key in element_rows}
    for key, row_names in ROW_NAMES.get(rule, {}).items():
        if key not in element_rows:
            continue
        if len(row_names) == 1:
            names.setdefault(row_names[0], StateName(key, None))
        elif len(row_names) == element_rows[key]:
            for row, name in enumerate(row_names):
                names.setdefault(name, StateName(key, row))
    return names
