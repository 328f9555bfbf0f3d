"""DeepSpeed's parameter-level optimizer-state API under BnbZeroOptimizer: dequantized fp32 moments by name.

Mirrors deepspeed/utils/tensor_fragment.py. DeepSpeed's ZeRO-1/2 links every model parameter to its fragment of the
flat fp32 partition (`param._hp_mapping`, a `tensor_fragment`) and, after the first step, narrows each optimizer-state
tensor shaped like the partition into `optim_fragment` (`lazy_init_hp_params_optimizer_state`). On bnb state that
hands out uint8 codes as if they were moments (`state1` comes back as code numbers cast to float), misses the packed
state of fp32-state parameters and knows no `exp_avg`; the local functions are ZeRO-3 only (an assertion). Here:
- `link_param_states` (from BnbZeroOptimizer._link_all_hp_params, so every DeepSpeed relink) gives each parameter a
  ParamOptimizerState, swaps its fragment for a BnbTensorFragment and rebinds `get_full_hp_param` /
  `set_full_hp_param`, which DeepSpeed's `safe_{get,set}_full_optimizer_state` call;
- `safe_{get,set}_local_optimizer_state` below replace DeepSpeed's (in deepspeed.utils and its tensor_fragment
  module; registered in overrides.py) so that they answer for these parameters too; every other parameter
  keeps DeepSpeed's behaviour.

What the four functions return / accept for a parameter of an engine stepped by BnbZeroOptimizer:
- keys: bnb's per-element state keys (`state1`, and `state2` for two-state rules) and torch's names for them
  (optim/state_names.py: Adam `exp_avg` / `exp_avg_sq`, Lion `exp_avg`, SGD `momentum_buffer`, ...), for 8-bit and
  fp32-state parameters alike. Any other key (absmax, qmap, step, an unknown name) is a ValueError naming the key, the
  parameter, the optimizer, why, and the keys that exist; it is raised on every rank alike, before any collective.
- get: fp32; 8-bit codes dequantized as bnb's dequantize_blockwise does (qmap[code] * absmax[block]); a copy, never a
  view of the state. full: the parameter's shape, AdEMAMix's two-row `state1` as bnb holds it, (2, *shape); its rows
  are also `exp_avg` (fast EMA) and `exp_avg_slow`. Assembled with an all-reduce over the data-parallel group, so
  every rank calls it (as DeepSpeed's). local: this rank's fragment flattened, (numel,) or (2, numel), on the
  parameter's device: parameter elements [start, start + numel) of `param._hp_mapping.lp_fragment_address`; shape
  (0,) / (2, 0) on a rank that holds none of the parameter.
- set: fp32 state is copied; 8-bit state is requantized per 256-element block of the parameter (the block's absmax
  recomputed, each value to its nearest code: ops/reference.quantize_blockwise, the fused kernels' quantizer), so a
  get returns every value within half a quantization step. full: every rank writes its own fragment, without
  communication (as DeepSpeed's); local: this rank's fragment only. Values 8-bit state cannot hold (non-finite, or
  negative under bnb's unsigned map, i.e. Adam's `exp_avg_sq`) are refused before anything is written.
"""

import dataclasses
import importlib
import types
import weakref
from typing import Dict, List, Optional

import torch
from deepspeed import comm as dist
from deepspeed.utils.tensor_fragment import tensor_fragment

from deepspeed_bnb.ops import compensated
from deepspeed_bnb.ops.reference import dequantize_blockwise, quantize_blockwise
from deepspeed_bnb.optim.bnb_adapter import StateKey
from deepspeed_bnb.optim.state_classes import REGISTRY, StateClass
from deepspeed_bnb.optim.state_names import StateName, public_names
from deepspeed_bnb.installer import stock
from deepspeed_bnb.state_layout import Segment

PARAM_STATE_ATTR = "_bnb_optimizer_state"  # model-parameter attribute holding its ParamOptimizerState
# the module itself: `import deepspeed.utils.tensor_fragment as m` gives the class that deepspeed.utils re-exports
ds_tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
_CODES_PREFIX = "state"  # bnb pairs 8-bit codes `state<i>` with their scale `absmax<i>` and map `qmap<i>`

_WHY_NOT = {  # class of a bnb key that is not per-element state -> why these functions do not return it
    StateClass.BLOCK: "holds one scale per 256-element block of 8-bit codes, not one value per element (the "
                      "moments it scales come dequantized under the keys below)",
    StateClass.WHOLE: "is a quantization map shared by every parameter, not state of this parameter",
    StateClass.SCRATCH: "is scratch space bnb rewrites at every step before reading it",
}


def _model_shape(param) -> torch.Size:
    """The model parameter's shape, also when ZeRO-3 has partitioned it (its `.data` is then empty)."""
    return torch.Size(getattr(param, "ds_shape", param.shape))


def _model_device(param) -> torch.device:
    """Where the parameter's full state is handed out: its ZeRO-3 partition's device, or its own."""
    partition = getattr(param, "ds_tensor", None)
    return partition.device if partition is not None else param.device


class ParamOptimizerState:
    """This rank's view of one model parameter's state in a BnbZeroOptimizer: dequantized on get, requantized on set."""

    def __init__(self, zero, group: int, slot: int, name: str, gindex: Optional[int] = None):
        self._zero = weakref.ref(zero)  # DeepSpeed's destroy() unlinks parameters to free the optimizer: never pin it
        self.group = group  # the optimizer's partition index (ZeRO-1/2: param group; ZeRO-3: sub-group)
        self.slot = slot  # the parameter's position in that partition's order (its segments' `slot`)
        self.gindex = group if gindex is None else gindex  # the bnb param group the partition belongs to
        self.name = name  # the parameter's name, for messages

    # ---- where the state is ---------------------------------------------------------------------------------

    def _optimizer(self):
        zero = self._zero()
        if zero is None:
            raise RuntimeError(f"deepspeed_bnb: the ZeRO optimizer that held the state of {self.name} no longer exists")
        return zero

    def segment(self) -> Optional[Segment]:
        """This rank's piece of the parameter, or None where the rank holds none of it."""
        return next((s for s in self._optimizer().bnb_segments[self.group] if s.slot == self.slot), None)

    def _eight_bit(self) -> bool:
        return self._optimizer().bnb_eight_bit[self.group][self.slot]

    def _flat_state(self) -> dict:
        zero = self._optimizer()
        return zero.optimizer.state[zero.bnb_partition_tensor(self.group)]

    def _specs(self) -> Dict[str, StateKey]:
        """bnb's state keys for this parameter's precision (probed once per precision by the adapter)."""
        zero = self._optimizer()
        device = zero.bnb_partition_tensor(self.group).device
        keys = zero.bnb.state_keys(zero.optimizer.param_groups[self.gindex], self.gindex, self._eight_bit(), device)
        return {key.name: key for key in keys}

    @staticmethod
    def _scale_keys(key: str):
        suffix = key[len(_CODES_PREFIX):]
        return f"absmax{suffix}", f"qmap{suffix}"

    def _element_rows(self, specs: Dict[str, StateKey]) -> Dict[str, int]:
        """Per-element keys this API can read -> their number of rows, 0 for none (uint8 codes need bnb's absmax and
        qmap keys)."""
        rows = {}
        for name, spec in specs.items():
            if spec.cls != StateClass.ELEMENT:
                continue
            if spec.template.dtype == torch.uint8 and not (
                    name.startswith(_CODES_PREFIX) and all(k in specs for k in self._scale_keys(name))):
                continue
            rows[name] = spec.template.shape[0] if spec.template.dim() == 2 else 0  # AdEMAMix's state1: 2
        return rows

    # ---- names --------------------------------------------------------------------------------------------------

    def names(self) -> Dict[str, StateName]:
        zero = self._optimizer()
        return public_names(zero.bnb.optimizer_name, self._element_rows(self._specs()))

    def keys(self) -> List[str]:
        return list(self.names())

    def _resolve(self, key) -> StateName:
        names = self.names()
        if key in names:
            return names[key]
        raise ValueError(self._refusal(key, names))

    def _refusal(self, key, names: Dict[str, StateName]) -> str:
        zero = self._optimizer()
        rule, specs = zero.bnb.optimizer_name, self._specs()
        precision = "8-bit" if self._eight_bit() else "fp32"
        cls = specs[key].cls if key in specs else REGISTRY.get(rule, {}).get(key)
        if cls == StateClass.SCALAR:
            value = self._flat_state().get(key)
            why = f"is one number for the whole param group (now {value}), not one value per element"
        elif key in specs and cls == StateClass.ELEMENT:
            why = "holds 8-bit codes without bnb's absmax/qmap pair, so it has no known dequantization"
        elif cls in _WHY_NOT and (key in specs or not self._eight_bit()):
            why = _WHY_NOT[cls] + ("" if key in specs else "; and only 8-bit-state parameters have it, this one "
                                   "has fp32 state")
        else:
            why = "is not a per-element state of this optimizer"
        return (f"deepspeed_bnb: optimizer state key {key!r} of parameter {self.name} ({precision} state, "
                f"{type(zero.optimizer).__name__}, bnb's '{rule}' update) {why}. The optimizer-state functions give "
                f"its fp32 moments (8-bit ones dequantized) under these keys: {', '.join(names)}.")

    def _lead(self, name: StateName) -> tuple:
        """Leading dimensions of a name's values: (2,) for AdEMAMix's whole state1, else ()."""
        rows = self._element_rows(self._specs())[name.key]
        return (rows,) if rows and name.row is None else ()

    # ---- storage ------------------------------------------------------------------------------------------------

    def _storage(self, key: str, seg: Segment):
        """(values view, absmax view, qmap) of a key over a segment; absmax and qmap are None for float state."""
        state, spec = self._flat_state(), self._specs()[key]
        start = seg.offset if seg.eight_bit else seg.fp32_offset
        values = state[spec.stored_as].narrow(-1, start, seg.numel)
        if values.dtype != torch.uint8:
            return values, None, None
        absmax_key, qmap_key = self._scale_keys(key)
        return values, state[absmax_key].narrow(-1, seg.first_block, seg.blocks), state[qmap_key]

    def _read(self, name: StateName, seg: Segment) -> torch.Tensor:
        values, absmax, qmap = self._storage(name.key, seg)
        out = dequantize_blockwise(values, absmax, qmap) if qmap is not None else values.float().clone()
        return out if name.row is None else out[name.row]

    def _write(self, name: StateName, seg: Segment, new: torch.Tensor) -> None:
        values, absmax, qmap = self._storage(name.key, seg)
        if name.row is not None:
            values, absmax = values[name.row], (absmax[name.row] if absmax is not None else None)
        new = new.to(device=values.device, dtype=torch.float32)
        if qmap is None:
            values.copy_(new)
            return
        # one row at a time: each row of AdEMAMix's state1 has its own absmax (bnb quantizes them separately)
        rows = zip(values.unbind(0), absmax.unbind(0), new.unbind(0)) if values.dim() == 2 else [(values, absmax, new)]
        for codes_row, absmax_row, new_row in rows:
            codes, scale = quantize_blockwise(new_row, qmap)
            codes_row.copy_(codes)
            absmax_row.copy_(scale)

    def _check_values(self, key: str, name: StateName, value: torch.Tensor) -> None:
        """Refuse, on every rank alike, values that this key's 8-bit codes cannot hold."""
        spec = self._specs()[name.key]
        if spec.template.dtype != torch.uint8:
            return
        bad = (~torch.isfinite(value)).sum().item()
        if bad:
            raise ValueError(f"deepspeed_bnb: {bad} non-finite values given for optimizer state {key!r} of "
                             f"{self.name}, which is stored as 8-bit codes scaled per 256-element block: one of them "
                             f"would turn its whole block into NaN. Pass finite values.")
        qmap = self._flat_state()[self._scale_keys(name.key)[1]]
        negative = (value < 0).sum().item()
        if negative and qmap.min() >= 0:
            raise ValueError(f"deepspeed_bnb: {negative} negative values given for optimizer state {key!r} of "
                             f"{self.name}, which bitsandbytes stores with its unsigned 8-bit map (it holds squares): "
                             f"they cannot be represented. Pass values >= 0.")

    # ---- the API --------------------------------------------------------------------------------------------

    def get_local(self, key, device=None) -> torch.Tensor:
        name = self._resolve(key)
        seg = self.segment()
        if seg is None:
            return torch.zeros((*self._lead(name), 0), dtype=torch.float32, device=device)
        values = self._read(name, seg)
        return values if device is None else values.to(device)

    def set_local(self, key, value) -> None:
        name = self._resolve(key)
        seg = self.segment()
        shape = (*self._lead(name), seg.numel if seg is not None else 0)
        value = torch.as_tensor(value)
        if value.numel() != torch.Size(shape).numel():
            raise ValueError(f"deepspeed_bnb: safe_set_local_optimizer_state({self.name}, {key!r}) takes this rank's "
                             f"fragment of the parameter, {torch.Size(shape).numel()} values {shape}, got "
                             f"{value.numel()} {tuple(value.shape)}.")
        self._check_values(key, name, value)
        if seg is not None:
            self._write(name, seg, value.reshape(shape))

    def get_full(self, param: torch.Tensor, key) -> torch.Tensor:
        name = self._resolve(key)
        lead, seg = self._lead(name), self.segment()
        shape, device = _model_shape(param), _model_device(param)
        buffer = torch.zeros((*lead, shape.numel()), dtype=torch.float32, device=device)
        if seg is not None:
            buffer.narrow(-1, seg.param_start, seg.numel).copy_(self._read(name, seg))
        dist.all_reduce(buffer, group=self._optimizer().bnb_partition_process_group(self.group))
        return buffer.reshape(*lead, *shape)

    def set_full(self, param: torch.Tensor, key, value) -> None:
        name = self._resolve(key)
        lead, seg = self._lead(name), self.segment()
        value = torch.as_tensor(value)
        shape = _model_shape(param)
        if value.numel() != torch.Size(lead).numel() * shape.numel():
            raise ValueError(f"deepspeed_bnb: safe_set_full_optimizer_state({self.name}, {key!r}) takes the whole "
                             f"state, {(*lead, *shape)}, got {tuple(value.shape)}.")
        self._check_values(key, name, value)
        if seg is not None:
            self._write(name, seg, value.reshape(*lead, shape.numel()).narrow(-1, seg.param_start, seg.numel))


@dataclasses.dataclass
class BnbTensorFragment(tensor_fragment):
    """DeepSpeed's link of a parameter to its fragment of the partition, with optimizer state read from bnb state."""

    param_state: Optional[ParamOptimizerState] = None  # answers every optimizer-state key of the parameter

    def get_optim_state_fragment(self, key):
        return self.param_state.get_local(key)

    def set_optim_state_fragment(self, flat_hp_partition, optim_fragment):
        # DeepSpeed caches narrowed views of every partition-shaped state tensor here after the first step (uint8 codes
        # included, fp32-state moments missed); the state is read when asked for instead, so nothing is cached.
        pass

    def get_optim_state_keys(self):
        return self.param_state.keys()


def _master_error(param) -> Optional[torch.Tensor]:
    """The int8 error term of the parameter's fragment of compensated master weights (None: fp32 or bf16 ones, or no
    fragment on this rank)."""
    state = getattr(param, PARAM_STATE_ATTR)
    errors = state._optimizer().bnb_master_errors
    address = param._hp_mapping.hp_fragment_address if param._hp_mapping is not None else None
    if errors[state.group] is None or address is None:
        return None
    return errors[state.group].narrow(0, address.start, address.numel)


def get_full_hp_param(self, optim_state_key=None):
    """`param.get_full_hp_param` of DeepSpeed, with optimizer-state keys answered from bnb state; the weights fp32,
    compensated master weights joined with their error terms (DeepSpeed's would give their bf16 part)."""
    if optim_state_key is not None:
        return getattr(self, PARAM_STATE_ATTR).get_full(self, optim_state_key)
    error = _master_error(self)
    if error is None:
        return ds_tensor_fragment.get_full_hp_param(self)  # fp32 (bf16 master weights widened)
    reduce_buffer = torch.zeros_like(self, dtype=torch.float32).flatten()
    address = self._hp_mapping.lp_fragment_address
    reduce_buffer.narrow(0, address.start, address.numel).copy_(
        compensated.join(self._hp_mapping.get_hp_fragment(), error))
    dist.all_reduce(reduce_buffer, group=self._dp_group)  # every rank's fragment, as DeepSpeed's
    return reduce_buffer.reshape_as(self)


def set_full_hp_param(self, value, optim_state_key=None):
    """`param.set_full_hp_param` of DeepSpeed, with optimizer-state keys written into bnb state; compensated master
    weights take the value split into bf16 and error term."""
    if optim_state_key is not None:
        return getattr(self, PARAM_STATE_ATTR).set_full(self, optim_state_key, value)
    error = _master_error(self)
    if error is None:
        return ds_tensor_fragment.set_full_hp_param(self, value)
    address = self._hp_mapping.lp_fragment_address
    compensated.split_(value.flatten().narrow(0, address.start, address.numel).float(),
                       self._hp_mapping.get_hp_fragment(), error)


def link_param_states(zero) -> None:
    """Route the optimizer-state keys of every parameter of a BnbZeroOptimizer through its ParamOptimizerState."""
    for g in range(len(zero.bit16_groups)):
        for slot, p in enumerate(zero.bnb_flat_params(g)):  # the model's parameters, in flat order
            state = ParamOptimizerState(zero, g, slot, zero.param_names.get(p, f"#{slot} of param group {g}"))
            setattr(p, PARAM_STATE_ATTR, state)
            if p._hp_mapping is not None:
                fields = {f.name: getattr(p._hp_mapping, f.name) for f in dataclasses.fields(tensor_fragment)}
                p._hp_mapping = BnbTensorFragment(**fields, param_state=state)
            p.get_full_hp_param = types.MethodType(get_full_hp_param, p)
            p.set_full_hp_param = types.MethodType(set_full_hp_param, p)


def _linked(param) -> Optional[ParamOptimizerState]:
    """The parameter's state view if a BnbZeroOptimizer linked it last (DeepSpeed rebinds get_full_hp_param on every
    link, so a parameter since taken over by another engine is not answered from a stale view)."""
    bound = getattr(param, "get_full_hp_param", None)
    if getattr(bound, "__func__", None) is not get_full_hp_param or hasattr(param, "ds_id"):
        return None
    return getattr(param, PARAM_STATE_ATTR, None)


def safe_get_local_optimizer_state(param, optim_state_key):
    """DeepSpeed's (ZeRO-3 only), and for a BnbZeroOptimizer's parameter its fragment of the state (module doc)."""
    state = _linked(param)
    if state is None:
        return stock("tensor_fragment.safe_get_local_optimizer_state")(param, optim_state_key)
    return state.get_local(optim_state_key, device=param.device)


def safe_set_local_optimizer_state(param, value, optim_state_key):
    """DeepSpeed's (ZeRO-3 only), and for a BnbZeroOptimizer's parameter a write of its fragment (module doc)."""
    state = _linked(param)
    if state is None:
        return stock("tensor_fragment.safe_set_local_optimizer_state")(param, value, optim_state_key)
    return state.set_local(optim_state_key, value)
