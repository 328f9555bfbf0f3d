"""A plain bitsandbytes run continued under ZeRO: its optimizer.state_dict() and weights as a deepspeed_bnb checkpoint.

bitsandbytes keeps each parameter's whole state (8-bit codes, per-block absmax, the quantization maps, step) in
`optimizer.state_dict()`, keyed by parameter index in param-group order. Two layouts exist: bitsandbytes before 0.49.2
returns torch's plain per-parameter dicts; 0.49.2 moves the quantization tensors of each parameter under
`__bnb_optimizer_quant_state__` (so that FSDP does not try to shard them). Both are read here (through the safe
loader), the parameters are named from the model weights (or an explicit list), and the per-parameter state is laid
out into ZeRO partitions exactly as a live engine holds it (param_state.scatter_param_states): no value changes, so
the run goes on where it stopped, at any DP size.
"""

import functools
import math
import os
from typing import Dict, List, Optional, Sequence

import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.safe_load import load_file
from deepspeed_bnb.checkpoint.format.stock_moments import QUANT_STATE_KEY  # bitsandbytes >= 0.49.2's layout
from deepspeed_bnb.checkpoint.tools.rank_files import RanklessSource, write_rank_files
from deepspeed_bnb.optim.flat_state import FlatKeys, bnb_name
from deepspeed_bnb.optim.state_classes import StateClass

OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")  # where training scripts put optimizer.state_dict()
MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")  # ... and model.state_dict()


def _unwrap(blob, keys: Sequence[str], is_it, path: str, what: str, key: Optional[str]):
    if key is not None:
        if not isinstance(blob, dict) or key not in blob:
            has = sorted(map(str, blob))[:10] if isinstance(blob, dict) else type(blob).__name__
            raise CheckpointMismatchError(f"{path} has no entry {key!r} (it has {has}).")
        return blob[key]
    if is_it(blob):
        return blob
    for candidate in keys:
        if isinstance(blob, dict) and is_it(blob.get(candidate)):
            return blob[candidate]
    raise CheckpointMismatchError(f"{path} holds no {what} at its top level or under {list(keys)}; name the entry "
                                  f"that holds it.")


def _is_optimizer_state(value) -> bool:
    return isinstance(value, dict) and "state" in value and "param_groups" in value


def _check_optimizer_state(value: dict, path: str) -> dict:
    """An optimizer state dict's structure, before anything counts on it: param groups with lists of parameter
    indices, and per-parameter states of named entries."""
    groups, state = value["param_groups"], value["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CheckpointMismatchError(f"{path}: 'param_groups' is not a list of param groups with their 'params'; "
                                      f"the optimizer state dict is malformed.")
    if not isinstance(state, dict) or not all(isinstance(s, dict) and all(isinstance(k, str) for k in s) and
                                              isinstance(s.get(QUANT_STATE_KEY, {}), dict) for s in state.values()):
        raise CheckpointMismatchError(f"{path}: 'state' is not a map of parameter indices to their state dicts; the "
                                      f"optimizer state dict is malformed.")
    return value


def _is_weights(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(torch.is_tensor(v) for v in value.values())


def read_weights(path: str, key: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """A model state dict from a torch or safetensors file (bare, or under MODEL_KEYS / `key`)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file as load_safetensors
        return load_safetensors(path)
    return dict(_unwrap(load_file(path), MODEL_KEYS, _is_weights, path, "model state dict (name -> tensor)", key))


def flat_param_states(optimizer_state: dict) -> List[dict]:
    """Per parameter index: bitsandbytes' state as one dict, whichever layout wrote it."""
    count = sum(len(group["params"]) for group in optimizer_state["param_groups"])
    states = []
    for index in range(count):
        state = dict(optimizer_state["state"].get(index, optimizer_state["state"].get(str(index), {})))
        state.update(state.pop(QUANT_STATE_KEY, {}))
        states.append(state)
    return states


class BnbRun(RanklessSource):
    """A plain bitsandbytes run's optimizer state dict and weights, as the source convert and write_rank_files read."""

    def __init__(self, optimizer_path: str, weights_path: str, names: Optional[List[str]] = None,
                 optimizer_key: Optional[str] = None, model_key: Optional[str] = None, stage: int = 2,
                 dp: int = 1):
        self.optimizer_path = optimizer_path
        self.optimizer_state = _check_optimizer_state(
            _unwrap(load_file(optimizer_path), OPTIMIZER_KEYS, _is_optimizer_state, optimizer_path,
                    "optimizer state dict ('state' and 'param_groups')", optimizer_key), optimizer_path)
        self.weights = read_weights(weights_path, model_key)
        self.states = flat_param_states(self.optimizer_state)
        self.names = self._names(names, weights_path)
        self.zero_stage, self.dp = stage, dp
        steps = {int(s["step"]) for s in self.states if "step" in s}
        self.step = max(steps) if steps else 0
        self.tag_dir = os.path.join(os.path.dirname(os.path.abspath(optimizer_path)), f"global_step{self.step}")

    def _names(self, names: Optional[List[str]], weights_path: str) -> List[str]:
        count = len(self.states)
        if names is None:
            if len(self.weights) != count:
                raise CheckpointMismatchError(
                    f"{weights_path} holds {len(self.weights)} tensors, but the optimizer state in "
                    f"{self.optimizer_path} has {count} parameters (buffers or tied weights are in the state dict): "
                    f"pass --param-names FILE, one name per line in the order the optimizer got the parameters "
                    f"(e.g. `[n for n, _ in model.named_parameters()]`).")
            names = list(self.weights)
        if len(names) != count:
            raise CheckpointMismatchError(f"--param-names lists {len(names)} names; the optimizer state has {count} "
                                          f"parameters.")
        for i, (name, state) in enumerate(zip(names, self.states)):
            if name not in self.weights:
                raise CheckpointMismatchError(f"parameter #{i} {name!r} is not in {weights_path}.")
            numel = self.weights[name].numel()
            state1 = state.get("state1")
            if state1 is None and state:
                raise CheckpointMismatchError(f"parameter #{i} ({name}) in {self.optimizer_path} has state keys "
                                              f"{sorted(state)}, not bitsandbytes' (state1, ...): this is not a "
                                              f"bitsandbytes optimizer's state dict.")
            if state1 is None:
                raise CheckpointMismatchError(f"parameter #{i} ({name}) has no optimizer state in "
                                              f"{self.optimizer_path} (never stepped); convert needs every "
                                              f"parameter's state.")
            if state1.numel() % max(numel, 1):
                raise CheckpointMismatchError(f"parameter #{i} ({name}) has {numel} elements in {weights_path} but "
                                              f"state1 of {state1.numel()} in {self.optimizer_path}: the names are "
                                              f"not in the optimizer's order (pass --param-names).")
        return list(names)

    # -- what convert and write_rank_files read --
    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        shapes, start = [], 0
        for group in self.optimizer_state["param_groups"]:
            names = self.names[start:start + len(group["params"])]
            shapes.append({name: self.weights[name].shape for name in names})
            start += len(group["params"])
        return shapes

    def group_slice(self, g: int) -> slice:
        start = sum(len(group["params"]) for group in self.optimizer_state["param_groups"][:g])
        return slice(start, start + len(self.optimizer_state["param_groups"][g]["params"]))

    def hyperparams(self, g: int) -> dict:
        return {k: v for k, v in self.optimizer_state["param_groups"][g].items() if k != "params"}

    def master_weights(self, g: int) -> List[torch.Tensor]:
        return [self.weights[name].reshape(-1).float() for name in self.names[self.group_slice(g)]]

    def param_states(self, g: int, key_classes: FlatKeys, templates: dict) -> List[dict]:
        """The group's per-parameter states shaped for scatter_param_states, each checked against the target class's
        keys, and its tensors against the templates' rows and dtypes and the parameter's size."""
        out = []
        for name, state in zip(self.names[self.group_slice(g)], self.states[self.group_slice(g)]):
            numel = self.weights[name].numel()
            eight_bit = state["state1"].dtype == torch.uint8
            wanted = {bnb_name(k): (k, key_classes[k]) for k in key_classes.of_precision(eight_bit)}
            unkept = sorted(key for key in state if key.startswith("state") and key[5:].isdigit() and key not in wanted)
            if unkept:  # another rule's state (AdamW's state2 given to Lion's class): carried over, it would be lost
                raise CheckpointMismatchError(f"{self.optimizer_path}: parameter {name} has {unkept}, which the "
                                              f"optimizer class given does not keep (it keeps {sorted(wanted)}); the "
                                              f"state is of another optimizer: give the run's own class.")
            flat = {}
            for key, (stored, cls) in wanted.items():
                if key not in state:
                    raise CheckpointMismatchError(f"{self.optimizer_path}: parameter {name} has no {key!r} (it has "
                                                  f"{sorted(state)}); the state is not of the optimizer class given.")
                flat[key] = self._checked(state[key], templates[stored], cls, numel, f"parameter {name}, {key!r}")
            out.append(flat)
        return out

    def _checked(self, value, template, cls: StateClass, numel: int, where: str):
        """`value` shaped as the partition code expects it ((rows, numel) / (rows, blocks), the template's rows and
        dtype), or an error naming the file when it cannot be: a size read from a file is checked before use."""
        if cls == StateClass.SCALAR:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise CheckpointMismatchError(f"{self.optimizer_path}: {where} is {str(value)[:80]}, not a number.")
            return value
        expected = (*template.shape[:-1], cls.length(numel)) if cls.partitioned else tuple(template.shape)
        if not torch.is_tensor(value) or value.numel() != math.prod(expected) or value.dtype != template.dtype:
            got = f"{tuple(value.shape)} {value.dtype}" if torch.is_tensor(value) else type(value).__name__
            raise CheckpointMismatchError(f"{self.optimizer_path}: {where} is {got}; the optimizer class given keeps "
                                          f"{expected} {template.dtype} for this parameter. The state is damaged or "
                                          f"of another optimizer or model.")
        return value.reshape(expected)

    @functools.cached_property
    def model_states(self) -> dict:
        import deepspeed
        param_names = set(self.names)
        return {"module": dict(self.weights), "param_shapes": self.param_shapes(),
                "buffer_names": [n for n in self.weights if n not in param_names], "dp_world_size": self.dp,
                "mp_world_size": 1, "global_steps": self.step, "skipped_steps": 0, "ds_version": deepspeed.__version__,
                "ds_config": {"zero_optimization": {"stage": self.zero_stage}}}


def convert_from_bnb(optimizer_path: str, weights_path: str, out_dir: str, optimizer_class: str,
                     names: Optional[List[str]] = None, dp: int = 1, stage: int = 2, progress: bool = True,
                     optimizer_key: Optional[str] = None, model_key: Optional[str] = None,
                     allow_large_dp: bool = False) -> str:
    """Write a plain bnb run (optimizer state dict + weights) as a deepspeed_bnb checkpoint for `dp` ranks at ZeRO
    `stage`; returns a report line."""
    from deepspeed_bnb.checkpoint.tools.convert import _build, _load_class, group_filler
    from deepspeed_bnb.checkpoint.tools.rank_files import check_dp
    from deepspeed_bnb.optim.bnb_adapter import BnbAdapter
    from deepspeed_bnb.state_layout import BLOCK_SIZE
    check_dp("convert --from-bnb", dp, allow_large_dp)
    if stage not in (1, 2, 3):
        raise ValueError(f"convert --from-bnb: --stage must be 1, 2 or 3 (a ZeRO stage), got {stage}")
    cls = _load_class(optimizer_class)
    run = BnbRun(optimizer_path, weights_path, names, optimizer_key, model_key, stage, dp)
    plans, counts, shapes = [], {"8bit": 0, "fp32": 0}, run.param_shapes()
    for g, group_shapes in enumerate(shapes):
        states = run.states[run.group_slice(g)]
        eight_bit = [s["state1"].dtype == torch.uint8 for s in states]
        optimizer = _build(cls, optimizer_class, run.hyperparams(g), "8bit" if any(eight_bit) else "32bit")
        group = optimizer.param_groups[0]
        adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), BLOCK_SIZE)
        steps = {int(s.get("step", 0)) for s in states}
        if len(steps) > 1:  # a ZeRO partition steps its parameters together
            raise CheckpointMismatchError(f"{optimizer_path}: the parameters of param group {g} are at different "
                                          f"steps {sorted(steps)}; ZeRO keeps one step per param group.")
        key_classes, templates = adapter.flat_keys(group, 0, eight_bit, "cpu")
        per_param = run.param_states(g, key_classes, templates)
        for state, name in zip(per_param, group_shapes):  # 8-bit codes mean what the target's maps say
            for key, template in key_classes.whole(templates).items():
                if key in state and not torch.equal(state[key], template):
                    raise CheckpointMismatchError(f"{optimizer_path}: parameter {name} has a {key} that differs from "
                                                  f"{optimizer_class}'s; its codes cannot be carried over.")
        hyperparams = {**{k: v for k, v in group.items() if k != "params"}, **run.hyperparams(g)}
        plans.append((eight_bit, key_classes, templates, hyperparams, per_param, run.master_weights(g)))
        counts["8bit"] += sum(eight_bit)
        counts["fp32"] += len(eight_bit) - sum(eight_bit)
    rule = getattr(optimizer, "optimizer_name", "?")  # the class's update rule, the same for every group
    written = write_rank_files(run, out_dir, dp, group_filler(plans, shapes, stage, dp),
                               f"{cls.__module__}.{cls.__qualname__}", rule, progress, stage)
    return (f"wrote {written}: {len(run.names)} parameters of a plain bitsandbytes run at step {run.step} for "
            f"{optimizer_class} ({counts['8bit']} with 8-bit state, {counts['fp32']} fp32), {dp} data-parallel "
            f"rank(s), ZeRO stage {stage}; state carried over unchanged")
