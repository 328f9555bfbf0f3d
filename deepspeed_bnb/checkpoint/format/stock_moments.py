"""Adam's two moments of one flat partition of a stock DeepSpeed checkpoint: torch's, or a bitsandbytes optimizer's.

Stock ZeRO (1/2 rigid, 1/2 elastic, 3) saves each rank's optimizer state of its flat fp32 partition (or sub-group):
torch's AdamW keeps `exp_avg` / `exp_avg_sq` there, one value per element. A bitsandbytes Adam-family optimizer
stepped by stock DeepSpeed keeps its own state of that flat tensor instead, whole on each rank: `state1` / `state2`
(uint8 codes with `absmax1/2` per 256-element block counted from the partition's first element and the maps
`qmap1/2`; or fp32 moments below its min_8bit_size), since bitsandbytes 0.49.2 with the quantization tensors under
`__bnb_optimizer_quant_state__` in a rigid save (bnb's state_dict). The moments are those codes dequantized (bnb's
formula, qmap[code] * absmax[block]), exactly what the stock run's next step would have read. DeepSpeed's elastic
save (`elastic_checkpoint: true`) drops the last `padding` entries of every state tensor of a rank whose partition is
padded (`_get_state_without_padding`), the maps and the per-block scales too: the scales of that partition's last
blocks are gone, and such a checkpoint's moments are refused, by name (its weights still load).
"""

from typing import Dict

import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.ops.reference import BLOCK_SIZE, dequantize_blockwise

MOMENTS = ("exp_avg", "exp_avg_sq")  # torch Adam's moments: what `convert` reads, and gives bnb's state1 / state2
BNB_MOMENTS = ("state1", "state2")  # a bitsandbytes Adam-family optimizer's two states, in that order
QUANT_STATE_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.49.2's state_dict: quantization tensors
MAP_SIZE = 256  # entries of an 8-bit quantization map


def not_adam_state(where: str, held) -> CheckpointMismatchError:
    """The error for a stock checkpoint whose optimizer state `held` (its keys) is not Adam's two moments."""
    hint = (" It is a bitsandbytes optimizer with one state (Lion, SGD with momentum, RMSprop, Adagrad): convert "
            "reads Adam-family state only; load its weights only (load_optimizer_states=False) into a deepspeed_bnb "
            "engine and train on." if "state1" in held else "")
    return CheckpointMismatchError(f"{where} holds optimizer state keys {sorted(held)}, not Adam's exp_avg / "
                                   f"exp_avg_sq (nor a bitsandbytes Adam's state1 / state2): convert cannot read "
                                   f"it.{hint}")


def adam_moments(state: dict, where: str) -> Dict[str, torch.Tensor]:
    """{"exp_avg", "exp_avg_sq"} -> fp32 values of one flat partition's optimizer `state` (torch's or bnb's)."""
    if not isinstance(state, dict):
        raise not_adam_state(where, [])
    if all(torch.is_tensor(state.get(key)) for key in MOMENTS):
        return {key: state[key].float() for key in MOMENTS}
    state = {**state, **state.get(QUANT_STATE_KEY, {})}
    state.pop(QUANT_STATE_KEY, None)
    if not all(torch.is_tensor(state.get(key)) for key in BNB_MOMENTS):
        raise not_adam_state(where, list(state))
    if "max1" in state:  # bnb's non-blockwise 8-bit state (block_wise=False): one scale per tensor, not per block
        raise CheckpointMismatchError(f"{where} holds bitsandbytes 8-bit state without blocks (block_wise=False: "
                                      f"'max1'); convert reads blockwise state only (bnb's default). Load its weights "
                                      f"only (load_optimizer_states=False) into a deepspeed_bnb engine and train on.")
    return {key: _moment(state, i, where) for i, key in enumerate(MOMENTS, start=1)}


def _moment(state: dict, i: int, where: str) -> torch.Tensor:
    codes = state[f"state{i}"].reshape(-1)
    if codes.dtype != torch.uint8:  # 32-bit state (a partition below min_8bit_size): the moments themselves
        return codes.float()
    absmax, qmap = state.get(f"absmax{i}"), state.get(f"qmap{i}")
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
