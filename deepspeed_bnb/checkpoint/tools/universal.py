"""DeepSpeed universal checkpoints, both ways: a deepspeed_bnb checkpoint exported as one, and one read as a source.

DeepSpeed's universal format (deepspeed/checkpoint/ds_to_universal.py writes it, `"checkpoint": {"load_universal":
true}` reads it) keeps every parameter whole and unpartitioned, one folder per parameter name under `<tag>/zero/`:
`fp32.pt`, one `<key>.pt` per optimizer-state key (`{"param": tensor}`; the stage-1/2 loader turns each file name into
a state key) and `step.pt`; `zero/optimizer_state.pt` carries the param groups (stage 1/2 read `param_groups` and
`ds_version`, stage 3 `optimizer_state_dict`), `latest_universal` names the tag. ds_to_universal cannot read bnb
state (`KeyError: 'exp_avg'`: it expects torch's moment names, and bnb's 8-bit codes are not element-wise values
anyway). Here, two kinds:
- 8-bit (the default): each parameter's state as bnb holds it, whole (8-bit codes, block scales, step; 32-bit state
  for bnb's small parameters), in `<parameter>/bnb/state.pt` (a ParamState record), the quantization maps once in
  `zero/optimizer_state.pt`, beside DeepSpeed's `fp32.pt`. Any bnb optimizer's state names, a quarter of the bytes of
  fp32 moments. The state lives in a sub-folder because DeepSpeed's loader takes every `*.pt` file of the parameter
  folder as a torch state key; and `optimizer_state.pt` has no `param_groups`, so a stock engine stops there instead
  of loading the weights with fresh moments.
- stock (`stock=True`): each parameter's bnb state dequantized to fp32 under torch's Adam names (exp_avg,
  exp_avg_sq), its fp32 master weights and step, so a stock engine with torch.optim.AdamW loads it with DeepSpeed's
  own loader at any DP size, stage and tensor-parallel layout DeepSpeed supports.
Only plain tensors and builtins are written. `UniversalCheckpoint` reads either (or ds_to_universal's) as a source.
"""

import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.constants import MODEL_STATES, STAGE3_MODEL_STATES
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.manifest import LATEST_UNIVERSAL, pointer_tag, read_manifest, safe_name, verify
from deepspeed_bnb.checkpoint.format.merged import buffers_and_frozen
from deepspeed_bnb.checkpoint.format.publish import offline_write, publish_staged, write_json_atomic
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint, check_model_states, check_unlisted
from deepspeed_bnb.checkpoint.format.safe_load import load_file
from deepspeed_bnb.checkpoint.format.weights import FROZEN_FRAGMENTS, FROZEN_SHAPES, fp32_moments, frozen_weights
from deepspeed_bnb.checkpoint.tools.rank_files import RanklessSource, check_output
from deepspeed_bnb.optim.param_state import ParamState
from deepspeed_bnb.optim.state_names import (ADAM_ROWS, ADAM_STATE_RULES, ALL_TORCH_NAMES, TRUST_RATIO_RULES, KeyRows,
                                             key_rows, row_names)

ZERO_DIR = "zero"  # per-parameter folders and optimizer_state.pt
BNB_DIR = "bnb"  # a parameter folder's sub-folder holding its 8-bit state (not a `*.pt` name DeepSpeed's loader takes)
BNB_STATE = "state.pt"  # the ParamState record in it
BNB_UNIVERSAL = "deepspeed_bnb_universal"  # optimizer_state.pt's entry of an 8-bit universal checkpoint
BNB_UNIVERSAL_VERSION = 1  # of that entry and the per-parameter layout; goes up when an older reader would misread it
OPTIMIZER_STATE = "optimizer_state.pt"
PARAM = "param"  # DeepSpeed's key for the whole tensor in a per-parameter file (checkpoint.constants.PARAM)
MOMENTS = ("exp_avg", "exp_avg_sq")  # torch Adam's names for bnb's state1, state2
# bnb update rules whose state a torch AdamW takes as its own (LAMB's also needs a trust ratio: not exported)
TORCH_ADAMW_RULES = tuple(rule for rule in ADAM_STATE_RULES if rule not in TRUST_RATIO_RULES)
# Hyper-parameters torch.optim.AdamW shares with bnb's Adam family (bnb's others, alpha/t_alpha/t_beta3, are AdEMAMix's)
TORCH_ADAM_HYPERPARAMS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _whole(value, where: str) -> torch.Tensor:
    """The tensor of a per-parameter file: DeepSpeed writes `{"param": tensor, "cat_dim": ...}` or a bare tensor."""
    tensor = value.get(PARAM) if isinstance(value, dict) else value
    if not torch.is_tensor(tensor):
        raise CheckpointMismatchError(f"{where} holds {type(value).__name__}, not a tensor or a {{'{PARAM}': tensor}} "
                                      f"dict: it is not a DeepSpeed universal checkpoint file.")
    return tensor


def write_universal(ckpt: SavedCheckpoint, out_dir: str, progress: bool = True, stock: bool = False,
                    tag: Optional[str] = None) -> str:
    """Write `ckpt` (deepspeed_bnb) as a DeepSpeed universal checkpoint in `out_dir`; returns the tag directory.
    8-bit by default: every parameter's bnb state as it is, for engines of deepspeed_bnb. `stock`: torch AdamW's
    fp32 moments (an Adam-family optimizer only; bnb's dequantized ones, exact for fp32 state) for a stock engine.
    Either way the weights are the fp32 master weights. `tag`: the output's tag (default: the input's); another tag
    may be written beside the input, as DeepSpeed's ds_to_universal writes `<tag>_universal`."""
    record = ckpt.record(0)
    if stock and record[C.OPTIMIZER_NAME_KEY] not in TORCH_ADAMW_RULES:
        raise CheckpointMismatchError(f"{ckpt.tag_dir} holds '{record[C.OPTIMIZER_NAME_KEY]}' state "
                                      f"({ckpt.optimizer_class}); a universal export for a stock engine writes torch "
                                      f"AdamW state (exp_avg, exp_avg_sq) and needs an Adam-family optimizer. Leave "
                                      f"out --stock to keep the bnb state for an engine of deepspeed_bnb.")
    ckpt.refuse_experts("deepspeed-bnb export --universal")
    tag = tag or os.path.basename(os.path.normpath(ckpt.tag_dir))
    check_output(ckpt, out_dir, tag)
    with offline_write(out_dir, tag) as staged:  # removed again if anything below fails
        (_write_stock_files if stock else _write_8bit_files)(ckpt, record, staged, progress)
        _write_model_states(ckpt, staged)
        written = publish_staged(out_dir, tag, {"universal": True, "state": "fp32" if stock else "8bit",
                                                "source_optimizer_class": ckpt.optimizer_class}, save_latest=False)
    write_json_atomic(os.path.join(out_dir, LATEST_UNIVERSAL), tag)
    return written


def _parameter_folder(staged: str, name: str, ckpt) -> str:
    folder = os.path.join(staged, ZERO_DIR, safe_name(name, ckpt.tag_dir, "parameter"))
    os.makedirs(folder, exist_ok=True)
    return folder


def _write_8bit_files(ckpt: SavedCheckpoint, record: dict, staged: str, progress: bool) -> None:
    """zero/<parameter>/{fp32.pt, bnb/state.pt} and zero/optimizer_state.pt (param groups, maps) in `staged`."""
    whole: Dict[str, torch.Tensor] = {}  # whole keys (maps) stored once: the first parameter's, where they agree
    groups = []
    for g, shapes in enumerate(ckpt.param_shapes()):
        masters, states = ckpt.master_weights(g), ckpt.param_states(g)
        for (name, shape), master, state in tqdm(list(zip(shapes.items(), masters, states)), desc=f"group {g}",
                                                 disable=not progress):
            folder = _parameter_folder(staged, name, ckpt)
            torch.save({PARAM: master.reshape(shape).clone()}, os.path.join(folder, "fp32.pt"))
            shared = [k for k, value in state.whole().items() if torch.equal(whole.setdefault(k, value), value)]
            os.makedirs(os.path.join(folder, BNB_DIR))
            torch.save(state.to_record(leave_out=shared), os.path.join(folder, BNB_DIR, BNB_STATE))
        groups.append(record[C.GROUPS_KEY][g][C.HYPERPARAMS_KEY])
    version = ckpt.model_states.get("ds_version") or ckpt.source.blob(0).get("ds_version")
    torch.save({"ds_version": version,
                BNB_UNIVERSAL: {"version": BNB_UNIVERSAL_VERSION, "optimizer_class": ckpt.optimizer_class,
                                "optimizer_name": record[C.OPTIMIZER_NAME_KEY], "param_groups": groups,
                                "whole": whole}},
               os.path.join(staged, ZERO_DIR, OPTIMIZER_STATE))


def _write_stock_files(ckpt: SavedCheckpoint, record: dict, staged: str, progress: bool) -> None:
    """zero/<parameter>/{fp32, exp_avg, exp_avg_sq, step}.pt and zero/optimizer_state.pt in `staged`."""
    groups, steps = [], []
    for g, shapes in enumerate(ckpt.param_shapes()):
        masters, states = ckpt.master_weights(g), ckpt.param_states(g)
        group_steps = {int(state["step"]) for state in states}
        if len(group_steps) > 1:  # DeepSpeed's loader asserts one step per param group
            raise CheckpointMismatchError(f"{ckpt.tag_dir}: param group {g} has parameters at different steps "
                                          f"{sorted(group_steps)}; a universal checkpoint keeps one per group.")
        step = float(group_steps.pop()) if group_steps else 0.0
        for (name, shape), master, state in tqdm(list(zip(shapes.items(), masters, states)), desc=f"group {g}",
                                                 disable=not progress):
            folder = _parameter_folder(staged, name, ckpt)
            torch.save({PARAM: master.reshape(shape).clone()}, os.path.join(folder, "fp32.pt"))
            for key, value in zip(MOMENTS, fp32_moments(state)):
                torch.save({PARAM: value.reshape(shape).contiguous()}, os.path.join(folder, f"{key}.pt"))
            torch.save(torch.tensor(step), os.path.join(folder, "step.pt"))
        hyper = record[C.GROUPS_KEY][g][C.HYPERPARAMS_KEY]
        groups.append({k: (tuple(v) if isinstance(v, list) else v) for k, v in hyper.items()
                       if k in TORCH_ADAM_HYPERPARAMS})
        steps.append(step)
    source = ckpt.model_states
    version = source.get("ds_version") or ckpt.source.blob(0).get("ds_version")
    torch.save({"ds_version": version, "param_groups": groups,
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(steps[0] if steps else 0.0)}},
                                         "param_groups": groups}},
               os.path.join(staged, ZERO_DIR, OPTIMIZER_STATE))


def _write_model_states(ckpt: SavedCheckpoint, staged: str) -> None:
    """Model states for the stage-1/2 and stage-3 loaders (both kinds)."""
    source = ckpt.model_states
    states = {k: source[k] for k in ("global_steps", "skipped_steps", "global_samples", "lr_scheduler",
                                     "ds_version", "ds_config") if k in source}
    # The universal loader restores the trained weights from zero/, never from `module`: they are not copied (a
    # stage-3 source has none, and full copies would double the folder). What zero/ does not hold is: the buffers
    # (a strict load of the module fails without them) and the frozen parameters (whole, in `module` and as the
    # fragments a ZeRO-2 save writes), else the loading engine kept its own values of both without a word. A tag of
    # several model-parallel ranks gives them joined (merged.py), a pipeline's from its layer files.
    buffers, frozen = buffers_and_frozen(ckpt)
    module = {**buffers, **frozen}
    states["buffer_names"] = list(buffers)
    if frozen:
        states.update({FROZEN_SHAPES: {name: weights.shape for name, weights in frozen.items()},
                       FROZEN_FRAGMENTS: frozen})
    states.update(module=module, dp_world_size=1, mp_world_size=1, param_shapes=ckpt.param_shapes())
    for name in (MODEL_STATES, STAGE3_MODEL_STATES.format(0)):  # the names stage 1/2 and stage 3 loaders glob for
        torch.save(states, os.path.join(staged, name))


class UniversalCheckpoint(RanklessSource):
    """A DeepSpeed universal checkpoint (ours of either kind, or ds_to_universal's), read through the safe loader: per
    param group the parameter names and shapes, fp32 weights, Adam moments (or, 8-bit, each parameter's bnb state),
    step and hyper-parameters."""

    def __init__(self, path: str, dp: int = 1, stage: int = 2):
        """`dp`, `stage`: what a writer (convert) lays the state out for; the universal format has neither."""
        self.tag_dir = universal_tag_dir(path)
        if self.tag_dir is None:
            raise CheckpointMismatchError(f"{path} is not a DeepSpeed universal checkpoint (no {LATEST_UNIVERSAL} "
                                          f"file, no {ZERO_DIR}/{OPTIMIZER_STATE}).")
        self.manifest = read_manifest(self.tag_dir)
        if self.manifest is not None:
            verify(self.tag_dir, self.manifest, sorted(self.manifest["files"]))
        else:  # ds_to_universal writes none
            check_unlisted(self.tag_dir, ours=False)
        optimizer_path = os.path.join(self.tag_dir, ZERO_DIR, OPTIMIZER_STATE)
        self.optimizer_state = load_file(optimizer_path)
        if not isinstance(self.optimizer_state, dict):
            raise CheckpointMismatchError(f"{optimizer_path} holds {type(self.optimizer_state).__name__}, not a "
                                          f"DeepSpeed universal optimizer state (a dict).")
        for name in (MODEL_STATES, STAGE3_MODEL_STATES.format(0)):
            path = os.path.join(self.tag_dir, name)
            if os.path.isfile(path):
                self.model_states = check_model_states(load_file(path), path)
                break
        else:
            raise CheckpointMismatchError(f"{self.tag_dir} has no model-states file ({MODEL_STATES}).")
        self.zero_stage, self.dp = stage, dp
        self.bnb = self._bnb_entry(optimizer_path)
        # DeepSpeed's ds_to_universal of a tensor-parallel run joins every trained parameter's fp32 weights and moments
        # in zero/, but copies model-parallel rank 0's model states: its param_shapes are that rank's slices, and its
        # frozen parameters that rank's share (which nothing joins: DeepSpeed 0.19.8's converter stops on them unless
        # --no_strict). The shapes are read from zero/ instead; the frozen shares are left out, loudly
        self.sliced_model_states = self.manifest is None and (self.model_states.get("mp_world_size") or 1) > 1
        self._joined_shapes = None  # param_shapes read from zero/ (sliced model states), once
        if self.sliced_model_states:
            self._leave_out_frozen_shares()

    def _leave_out_frozen_shares(self) -> None:
        frozen = frozen_weights(self)
        if not frozen:
            return
        warnings.warn(f"deepspeed_bnb: {self.tag_dir} is DeepSpeed's universal checkpoint of a run of "
                      f"{self.model_states['mp_world_size']} model-parallel ranks, whose model states hold rank 0's "
                      f"share of the frozen parameters {sorted(frozen)[:5]}{' ...' if len(frozen) > 5 else ''}: "
                      f"they are not loaded, and the engine keeps its own values of them (the pretrained weights it "
                      f"was built with, for a frozen layer).", RuntimeWarning, stacklevel=3)
        module = {k: v for k, v in (self.model_states.get("module") or {}).items() if k not in frozen}
        self.model_states = {**{k: v for k, v in self.model_states.items() if k not in (FROZEN_SHAPES,
                                                                                      FROZEN_FRAGMENTS)},
                             "module": module}

    def _bnb_entry(self, optimizer_path: str):
        """The 8-bit kind's entry of optimizer_state.pt, checked; None for the fp32 kinds."""
        entry = self.optimizer_state.get(BNB_UNIVERSAL)
        if entry is None:
            return None
        fields = {"version", "optimizer_class", "optimizer_name", "param_groups", "whole"}
        if not isinstance(entry, dict) or set(entry) != fields:
            got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise CheckpointMismatchError(f"{optimizer_path}: its {BNB_UNIVERSAL} entry should hold "
                                          f"{sorted(fields)}, not {got}")
        if entry["version"] != BNB_UNIVERSAL_VERSION:
            raise CheckpointMismatchError(f"{optimizer_path}: 8-bit universal checkpoint version "
                                          f"{entry['version']!r}; this deepspeed_bnb reads version "
                                          f"{BNB_UNIVERSAL_VERSION}. Upgrade deepspeed_bnb to read it.")
        if not (isinstance(entry["param_groups"], list) and all(isinstance(g, dict) for g in entry["param_groups"])
                and isinstance(entry["whole"], dict) and all(torch.is_tensor(v) for v in entry["whole"].values())
                and isinstance(entry["optimizer_name"], str) and isinstance(entry["optimizer_class"], str)):
            raise CheckpointMismatchError(f"{optimizer_path}: its {BNB_UNIVERSAL} entry holds values of the wrong "
                                          f"types (param_groups: a list of dicts, whole: tensors, names: strings)")
        return entry

    @property
    def optimizer_name(self):
        """bnb's update rule of an 8-bit universal checkpoint (None for the fp32 kinds: torch Adam's state)."""
        return self.bnb["optimizer_name"] if self.bnb else None

    def param_states(self, g: int) -> List[ParamState]:
        """Every parameter's bnb state, as the 8-bit kind holds it (the fp32 kinds hold Adam moments: `moments`)."""
        if not self.bnb:
            raise CheckpointMismatchError(f"{self.tag_dir} holds fp32 Adam moments, not bnb state")
        states = []
        for name, shape in self.param_shapes()[g].items():
            path = os.path.join(self.tag_dir, ZERO_DIR, safe_name(name, self.tag_dir, "parameter"), BNB_DIR,
                                BNB_STATE)
            try:
                states.append(ParamState.from_record(load_file(path), torch.Size(shape).numel(), path,
                                                     self.bnb["whole"]))
            except ValueError as exc:
                raise CheckpointMismatchError(str(exc)) from None
        return states

    def _param_groups(self) -> List[dict]:
        if self.bnb:
            return [dict(group) for group in self.bnb["param_groups"]]
        groups = self.optimizer_state.get("param_groups")  # stage 1/2 form; stage 3's lives one level down
        if groups is None:
            groups = self.optimizer_state.get("optimizer_state_dict", {}).get("param_groups", [])
        return [{k: v for k, v in group.items() if k != "params"} for group in groups]

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        saved = [dict(shapes) for shapes in self.model_states.get("param_shapes", [])]
        groups = len(self._param_groups())
        if not saved:
            raise CheckpointMismatchError(f"{self.tag_dir}: the model states hold no param_shapes; the parameters of "
                                          f"the checkpoint cannot be named.")
        if len(saved) != groups:  # ZeRO-3 sources list sub-groups
            if groups != 1:
                raise CheckpointMismatchError(f"{self.tag_dir}: param_shapes lists {len(saved)} groups for {groups} "
                                              f"optimizer param groups; which parameter belongs to which group is "
                                              f"unknown.")
            saved = [{name: shape for shapes in saved for name, shape in shapes.items()}]
        if self.sliced_model_states:  # rank 0's slices: the whole shapes are those of the joined fp32 weights
            if self._joined_shapes is None:
                self._joined_shapes = [
                    {name: _whole(self._param_file(name, "fp32"), f"{self.tag_dir}/{ZERO_DIR}/{name}/fp32.pt").shape
                     for name in shapes} for shapes in saved]
            saved = [dict(shapes) for shapes in self._joined_shapes]
        return saved

    def _param_file(self, name: str, key: str) -> torch.Tensor:
        path = os.path.join(self.tag_dir, ZERO_DIR, safe_name(name, self.tag_dir, "parameter"), f"{key}.pt")
        if not os.path.isfile(path):
            raise CheckpointMismatchError(f"{path} is missing: a universal checkpoint of the target's state has fp32 "
                                          f"and its moments (Adam: exp_avg, exp_avg_sq) for every parameter.")
        return load_file(path)

    def _tensor(self, name: str, key: str, shape) -> torch.Tensor:
        tensor = _whole(self._param_file(name, key), f"{self.tag_dir}/{ZERO_DIR}/{name}/{key}.pt")
        if tensor.numel() != torch.Size(shape).numel():
            raise CheckpointMismatchError(f"{self.tag_dir}/{ZERO_DIR}/{name}/{key}.pt has {tensor.numel()} elements, "
                                          f"the parameter {tuple(shape)}: padded (vocabulary) or tensor-parallel "
                                          f"slices are not read.")
        return tensor.reshape(-1).float()

    def _step(self, name: str) -> int:
        path = os.path.join(self.tag_dir, ZERO_DIR, name, "step.pt")
        if os.path.isfile(path):  # stage 1/2 conversions: one per parameter
            value = load_file(path)
        else:  # stage 3 conversions: one for all, in the torch state of the flat group
            value = self.optimizer_state.get("optimizer_state_dict", {}).get("state", {}).get(0, {}).get("step", 0)
        return int(value.item() if torch.is_tensor(value) else value)

    def moments(self, g: int, states=None, rows: KeyRows = ADAM_ROWS) -> List[Tuple[List[torch.Tensor], int]]:
        """Every parameter's moments of `rows` (Adam's by default) and step; `states`: the 8-bit kind's
        param_states(g), if already read."""
        names = row_names(rows)
        if self.bnb:
            if key_rows(self.optimizer_name) != rows:
                raise CheckpointMismatchError(f"{self.tag_dir} holds '{self.optimizer_name}' state "
                                              f"({self.bnb['optimizer_class']}), not the target's {names}")
            return [(fp32_moments(state), int(state["step"])) for state in states or self.param_states(g)]
        for name in self.param_shapes()[g]:  # another rule's moments beside them would be dropped: refused instead
            folder = os.path.join(self.tag_dir, ZERO_DIR, safe_name(name, self.tag_dir, "parameter"))
            held = {key for key in ALL_TORCH_NAMES if os.path.isfile(os.path.join(folder, f"{key}.pt"))}
            if held - set(names):
                raise CheckpointMismatchError(f"{folder} holds the moments {sorted(held)}; the target keeps "
                                              f"{tuple(names)}: give a class of the rule that wrote them.")
        return [([self._tensor(name, key, shape) for key in names], self._step(name))
                for name, shape in self.param_shapes()[g].items()]

    def master_weights(self, g: int) -> List[torch.Tensor]:
        return [self._tensor(name, "fp32", shape) for name, shape in self.param_shapes()[g].items()]

    def hyperparams(self, g: int) -> dict:
        return self._param_groups()[g]


def universal_tag_dir(path: str):
    """The tag directory of a universal checkpoint at `path` (a directory with latest_universal, or the tag itself),
    or None when `path` is not one."""
    tag = pointer_tag(path, LATEST_UNIVERSAL)
    if tag is not None:
        return os.path.join(path, tag)
    if os.path.isfile(os.path.join(path, ZERO_DIR, OPTIMIZER_STATE)):
        return path
    return None


def refuse_for_stock_engine(tag_dir: str) -> None:
    """A stock engine cannot take the 8-bit kind: DeepSpeed's loader would read the weights and (the state being in
    no file it reads) start every moment afresh. Raises for that kind, naming the export for stock engines."""
    path = os.path.join(tag_dir, ZERO_DIR, OPTIMIZER_STATE)
    held = load_file(path) if os.path.isfile(path) else {}
    if isinstance(held, dict) and BNB_UNIVERSAL in held:
        entry = held[BNB_UNIVERSAL] if isinstance(held[BNB_UNIVERSAL], dict) else {}
        raise CheckpointMismatchError(
            f"{tag_dir} is an 8-bit universal checkpoint: it holds bitsandbytes optimizer state "
            f"({entry.get('optimizer_class', '?')}) that this stock engine cannot take. Build the engine with that "
            f"bitsandbytes optimizer, or write a universal checkpoint for a stock engine with `deepspeed-bnb export "
            f"CHECKPOINT OUT --universal --stock`.")
