"""The per-element states (moments) of one flat partition of a stock DeepSpeed checkpoint: torch's, or a bitsandbytes
optimizer's.

Stock ZeRO (1/2 rigid, 1/2 elastic, 3) saves each rank's optimizer state of its flat fp32 partition (or sub-group):
torch's AdamW keeps `exp_avg` / `exp_avg_sq` there, one value per element (DeepSpeed's FusedLion `exp_avg`, torch's
SGD `momentum_buffer`, ...). A bitsandbytes optimizer stepped by stock DeepSpeed keeps its own state of that flat
tensor instead, whole on each rank: `state1` (and `state2` for the Adam family) as uint8 codes with `absmax1/2` per
256-element block counted from the partition's first element and the maps `qmap1/2`, or fp32 below its
min_8bit_size; since bitsandbytes 0.49.2 with the quantization tensors under `__bnb_optimizer_quant_state__` in a rigid
save (bnb's state_dict). The moments are those codes dequantized (bnb's formula, qmap[code] * absmax[block]), exactly
what the stock run's next step would have read (AdEMAMix's state1 holds two rows, its fast and slow EMAs, each with
its own blocks). bnb's files do not say which update rule wrote them: the reader takes the rule convert writes (the
target class's; at load, the engine's) and checks the count of states and of their rows against it.
DeepSpeed's elastic save (`elastic_checkpoint: true`) drops the last `padding` entries of every state tensor of a rank
whose partition is padded (`_get_state_without_padding`), the maps and the per-block scales too: the scales of that
partition's last blocks are gone, and such a checkpoint's moments are refused, by name (its weights still load).
"""

from typing import Dict

import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.ops.reference import BLOCK_SIZE, dequantize_blockwise
from deepspeed_bnb.optim.state_names import ADAM_ROWS, ALL_TORCH_NAMES, TORCH_NAMES, KeyRows, row_names

BNB_MOMENTS = ("state1", "state2")  # a bitsandbytes optimizer's per-element states, in that order
QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.49.2's state_dict: quantization tensors
MAP_SIZE = 256  # entries of an 8-bit quantization map
ONE_STATE = "Lion, SGD with momentum, RMSprop, Adagrad"  # bitsandbytes' optimizers with state1 alone
TWO_STATES = "Adam, AdamW, LAMB, AdEMAMix"  # and with state1 and state2


def not_readable(where: str, held, rows: KeyRows) -> CheckpointMismatchError:
    """The error for a stock checkpoint whose optimizer state `held` (its keys) is not the state `rows` convert
    writes."""
    bnb_states = [key for key in BNB_MOMENTS if key in held]
    if bnb_states:
        count, kind, example = (("one state", ONE_STATE, "bitsandbytes.optim.Lion8bit") if len(bnb_states) == 1 else
                                ("two states", TWO_STATES, "bitsandbytes.optim.AdamW8bit"))
        hint = (f" It is a bitsandbytes optimizer with {count} ({kind}), and its files do not say "
                f"which: convert it for the class the run used (--optimizer-class, e.g. {example}; at load the "
                f"engine's own optimizer), or load its weights only (load_optimizer_states=False) and train on.")
    else:
        rules = sorted(rule for rule, torch_names in TORCH_NAMES.items() if set(torch_names) == set(held))
        hint = (f" Those are the moments of bnb's {' or '.join(repr(rule) for rule in rules)} update rule: convert "
                f"them for a class of that rule." if rules else "")
    return CheckpointMismatchError(f"{where} holds optimizer state keys {sorted(held)}; the target optimizer keeps "
                                   f"{', '.join(row_names(rows))} (bnb's {', '.join(key for key, _ in rows)}), so "
                                   f"convert cannot give it that state.{hint}")


def flat_moments(state: dict, where: str, rows: KeyRows = ADAM_ROWS) -> Dict[str, torch.Tensor]:
    """{name: fp32 values} of one flat partition's optimizer `state`, for a rule whose state is `rows`
    (state_names.key_rows): torch's moments by those names (no other rule's), or bnb's state1[, state2], each with the
    rule's rows (AdEMAMix's state1: two)."""
    if not isinstance(state, dict):
        raise not_readable(where, [], rows)
    torch_held = {key for key in ALL_TORCH_NAMES if torch.is_tensor(state.get(key))}
    if torch_held:  # a torch (or DeepSpeed) optimizer's: exactly the target rule's moments, none left behind
        if torch_held != set(row_names(rows)):
            raise not_readable(where, sorted(torch_held), rows)
        return {key: state[key].float() for key in row_names(rows)}
    state = {**state, **state.get(QUANT_STATE_KEY, {})}
    state.pop(QUANT_STATE_KEY, None)
    if [key for key in BNB_MOMENTS if torch.is_tensor(state.get(key))] != [key for key, _ in rows]:
        raise not_readable(where, list(state), rows)
    shapes = {key: tuple(state[key].shape) for key, _ in rows}
    # a key of one row is flat, of several (AdEMAMix's state1: its two EMAs) (rows, numel): read as one, a row is lost
    if any(shapes[key][:-1] != ((len(names),) if len(names) > 1 else ()) for key, names in rows):
        raise CheckpointMismatchError(f"{where} holds bitsandbytes state of the shapes {shapes}; the target keeps "
                                      f"{dict((key, len(names)) for key, names in rows)} row(s) per element and key "
                                      f"(AdEMAMix keeps its fast and slow EMAs as two rows of state1), so convert "
                                      f"cannot give it that state. Convert it for the class the run used, or load its "
                                      f"weights only (load_optimizer_states=False) and train on.")
    if "max1" in state:  # bnb's non-blockwise 8-bit state (block_wise=False): one scale per tensor, not per block
        raise CheckpointMismatchError(f"{where} holds bitsandbytes 8-bit state without blocks (block_wise=False: "
                                      f"'max1'); convert reads blockwise state only (bnb's default). Load its weights "
                                      f"only (load_optimizer_states=False) into a deepspeed_bnb engine and train on.")
    out = {}
    for i, (key, names) in enumerate(rows, start=1):
        for row, name in enumerate(names):
            out[name] = _moment(state, i, row if len(names) > 1 else None, where)
    return out


def _moment(state: dict, i: int, row, where: str) -> torch.Tensor:
    """state{i} (its row `row`, when it has several: blocks counted from each row's start, as bnb counts them) as fp32
    values: 32-bit state as it is, 8-bit codes dequantized by bnb's formula."""
    codes = state[f"state{i}"]
    codes = (codes if row is None else codes[row]).reshape(-1)
    if codes.dtype != torch.uint8:  # 32-bit state (a partition below min_8bit_size): the moments themselves
        return codes.float()
    absmax, qmap = state.get(f"absmax{i}"), state.get(f"qmap{i}")
    if row is not None and torch.is_tensor(absmax):
        absmax = absmax[row] if absmax.dim() > 1 and absmax.shape[0] > row else None
    blocks = -(-codes.numel() // BLOCK_SIZE)
    if not torch.is_tensor(absmax) or absmax.numel() < blocks or not torch.is_tensor(qmap) or \
            qmap.numel() != MAP_SIZE:
        found = {name: tuple(value.shape) if torch.is_tensor(value) else value
                 for name, value in ((f"absmax{i}", absmax), (f"qmap{i}", qmap))}
        raise CheckpointMismatchError(
            f"{where}: bitsandbytes 8-bit state{i} of {codes.numel():,} codes needs absmax{i} of at least {blocks:,} "
            f"blocks and qmap{i} of {MAP_SIZE} entries; found {found}. DeepSpeed's elastic save (elastic_checkpoint: "
            f"true) drops the last entries of every state tensor of a padded partition, per-block scales and maps "
            f"included, so the scales of its last blocks are lost and these moments cannot be read back. Load its "
            f"weights only (load_optimizer_states=False) into a deepspeed_bnb engine and train on; a stock run saved "
            f"with elastic_checkpoint: false keeps the whole state.")
    return dequantize_blockwise(codes, absmax.reshape(-1).float(), qmap.reshape(-1))
