"""Offline precision switch: 32-bit optimizer state (torch / DeepSpeed AdamW, bnb 32-bit) <-> bnb 8-bit blockwise.

Reads a deepspeed_bnb checkpoint, a stock DeepSpeed ZeRO-1/2/3 checkpoint (ZeRO-3: format/stock_zero3.py; torch's
moments, or a bitsandbytes optimizer's state of each flat partition dequantized: format/stock_moments.py) or a
DeepSpeed universal checkpoint (universal.py; DeepSpeed's ds_to_universal writes Adam's moments only), takes the
moments the target class's rule keeps (state_names.key_rows: Adam's `exp_avg`, `exp_avg_sq`; AdEMAMix's two EMAs as
the rows of state1 and `exp_avg_sq`; or one state: Lion's `exp_avg`, SGD's `momentum_buffer`, RMSprop's `square_avg`,
Adagrad's `sum`), joins every parameter's, and writes a deepspeed_bnb checkpoint (same DP size; DP 1 from a
universal one: it loads at any) for the target bnb optimizer class: 8-bit parameters are quantized with bnb's own maps
and 256-element blocks (per row) to the nearest code (ops/reference.py; bnb's CPU look-up table misses small values
by up to ~50 code gaps, since it cannot hold 0), fp32 parameters keep the moments exactly. The report gives the
round-trip error of the quantized moments against the gap between the two codes around each value (one quantization
step): at most 0.5 by construction.
`--master-weights` switches the master weights between fp32, bf16 and compensated bf16+8 (switch_master_weights
alone, or with --to), exactly where the target holds the values and rounded as that mode rounds otherwise.
"""

import importlib
import inspect
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, BASE_OPTIMIZER_STATE_STEP, PARAM_SLICE_MAPPINGS
from tqdm import tqdm

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.param_state import scatter_param_states
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.records import empty_group_record
from deepspeed_bnb.checkpoint.format.stock_moments import flat_moments
from deepspeed_bnb.checkpoint.format.stock_zero3 import StockZero3
from deepspeed_bnb.checkpoint.format.weights import fp32_moments, stock_master_weights
from deepspeed_bnb.checkpoint.tools.rank_files import check_dp, check_output, source_master_mode, write_rank_files
from deepspeed_bnb.checkpoint.tools.reshape import reshape
from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint, universal_tag_dir
from deepspeed_bnb.ops.reference import code_gap, dequantize_blockwise, quantize_blockwise
from deepspeed_bnb.optim import master_weights
from deepspeed_bnb.optim.state_names import KeyRows, key_rows, row_names
from deepspeed_bnb.state_layout import BLOCK_SIZE, GroupLayout, ShardedLayout, uses_8bit_state

DEFAULT_CLASS = {"8bit": "bitsandbytes.optim.adamw.AdamW8bit", "32bit": "bitsandbytes.optim.adamw.AdamW"}
# a param group's settings a target class is built with: bnb's own (AdEMAMix's alpha and schedules too), and the torch
# arguments its SGD, RMSprop and Adagrad classes take (a torch optimizer's groups carry them; bnb refuses the values
# it does not implement)
HYPERPARAMS = ("lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3", "momentum", "dampening",
               "nesterov", "centered", "lr_decay", "initial_accumulator_value")
# bitsandbytes' one-state classes keep two of their torch arguments as the group's `betas` (Optimizer1State): RMSprop
# (alpha, momentum), SGD and LARS (momentum, dampening); a bnb group read back gives them to such a class by these
PACKED_BETAS = (("alpha", "momentum"), ("momentum", "dampening"))
# a torch optimizer's settings that change its update where bitsandbytes' rules have no such variant (bnb's SGD takes
# nesterov and ignores it; its momentum is m = momentum * m + g): a run converted with one of them on would go on under
# another rule
TORCH_VARIANTS = {"amsgrad": "AMSGrad's running maximum of the second moment", "maximize": "gradient ascent",
                  "nesterov": "Nesterov momentum", "dampening": "dampened momentum"}


def _load_class(qualified: str):
    """A bitsandbytes optimizer class by dotted name. Only modules of the bitsandbytes package are imported (the name
    is user input: `os.system` must not be called), and the result must be a bnb optimizer class."""
    module, _, name = qualified.rpartition(".")
    hint = f"give a bitsandbytes optimizer class as module.Class, e.g. {DEFAULT_CLASS['8bit']}"
    if module != "bitsandbytes" and not module.startswith("bitsandbytes."):
        raise ValueError(f"--optimizer-class {qualified!r} is not in the bitsandbytes package; {hint}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--optimizer-class {qualified!r} cannot be imported ({exc}); {hint}") from exc
    from bitsandbytes.optim.optimizer import Optimizer8bit
    if not (isinstance(cls, type) and issubclass(cls, Optimizer8bit)):
        raise ValueError(f"--optimizer-class {qualified!r} is not a bitsandbytes optimizer class; {hint}")
    return cls


def _build(cls, target: str, hyper: dict, to: str):
    """One-parameter instance of the target class, given the hyper-parameters it accepts (Lion has no eps, ...), with
    8-bit state where `to` asks for it and the class keeps 32-bit state unless told: bnb's AdamW(optim_bits=8) is
    what HF Trainer's `adamw_bnb_8bit` builds (bnb's 8-bit classes refuse any optim_bits but their default)."""
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in hyper.items() if k in HYPERPARAMS and k in accepted}
    if "betas" not in accepted and hyper.get("betas") is not None:  # a bnb group, for a class of torch's arguments
        pair = next((pair for pair in PACKED_BETAS if all(name in accepted for name in pair)), ())
        kwargs = {**dict(zip(pair, hyper["betas"])), **kwargs}
    try:
        optimizer = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        if to == "8bit" and optimizer.args.optim_bits != 8 and "optim_bits" in accepted:
            kwargs["optim_bits"] = 8
            optimizer = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        return optimizer
    except (TypeError, ValueError, NotImplementedError) as exc:  # bnb: NotImplementedError for SGD momentum 0, ...
        raise ValueError(f"convert: {target} cannot be built with the checkpoint's hyper-parameters {kwargs} "
                         f"({exc})") from exc


def _moments_of_record(ckpt: SavedCheckpoint, g: int, rows: KeyRows) -> List[Tuple[List[torch.Tensor], int]]:
    rule = ckpt.record(0)[C.OPTIMIZER_NAME_KEY]
    saved = key_rows(rule)
    if saved != rows:
        held = row_names(saved) if saved else "state convert does not know"
        raise CheckpointMismatchError(f"{ckpt.tag_dir} holds '{rule}' state ({ckpt.optimizer_class}): {held}; the "
                                      f"target class keeps {row_names(rows)}. convert switches one update rule's state "
                                      f"between precisions (or between rules of the same moments: Adam, AdamW, "
                                      f"LAMB), not from one rule to another: give a class of '{rule}'.")
    return [(fp32_moments(state), int(state["step"])) for state in ckpt.param_states(g)]


def _moments_of_stock(ckpt: SavedCheckpoint, g: int, rows: KeyRows) -> List[Tuple[List[torch.Tensor], int]]:
    """The moments of `rows` (exp_avg / exp_avg_sq, ...) of each parameter of a stock ZeRO checkpoint, joined over
    ranks (its slice mappings): torch's, or a bitsandbytes optimizer's state of the flat partition dequantized
    (stock_moments.py)."""
    names = row_names(rows)
    pieces: Dict[str, list] = OrderedDict((name, [[] for _ in names]) for name in ckpt.param_shapes()[g])
    step = None
    for rank in range(ckpt.dp):
        state = ckpt.optimizer_state(rank)
        base = state[BASE_OPTIMIZER_STATE]
        if isinstance(base, dict):  # rigid: a torch optimizer state_dict with one flat parameter per group
            flat = base["state"][base["param_groups"][g]["params"][0]]
        else:  # elastic: one trimmed state dict per group
            flat = base[g]
        moments = flat_moments(flat, ckpt.source.name(rank), rows)
        value = flat.get("step", state.get(BASE_OPTIMIZER_STATE_STEP))
        step = int(value.item() if torch.is_tensor(value) else value) if value is not None else step
        for name, address in state[PARAM_SLICE_MAPPINGS][g].items():
            for i, key in enumerate(names):
                pieces[name][i].append(moments[key].narrow(0, address.start, address.numel))
    return [([torch.cat(part) for part in parts], step or 0) for parts in pieces.values()]


def _stock_hyperparams(ckpt: SavedCheckpoint, g: int, given: Optional[List[dict]]) -> dict:
    """Param group g's hyper-parameters: a rigid stock checkpoint's own (its torch state_dict's param groups); for an
    elastic one, which keeps none, `given` (the user's, one dict per group), else an error saying so."""
    base = ckpt.optimizer_state(0)[BASE_OPTIMIZER_STATE]
    if isinstance(base, dict):  # convert() refused `given` for it
        return {k: v for k, v in base["param_groups"][g].items() if k != "params"}
    # DeepSpeed's elastic ZeRO-1/2 save (elastic_checkpoint: true) keeps each group's moments only, and its load
    # keeps the loading engine's hyper-parameters; the ds_config's optimizer section is empty for a client optimizer
    # and a default for every group otherwise, so nothing in the files says what each group had
    if given is None:
        raise CheckpointMismatchError(
            f"{ckpt.tag_dir} is an elastic stock DeepSpeed checkpoint (zero_optimization.elastic_checkpoint: true): "
            f"it keeps each param group's moments but not its hyper-parameters (lr, betas, eps, weight_decay), and "
            f"convert will not guess them. Give them with --param-groups, a JSON list of {len(base)} object(s) in the "
            f"run's param-group order, e.g. '[{{\"lr\": 1e-4, \"weight_decay\": 0.1}}, {{\"lr\": 1e-4, "
            f"\"weight_decay\": 0.0}}]' (keys left out take the target class's defaults); or load only its weights "
            f"into a deepspeed_bnb engine (load_optimizer_states=False) and train on.")
    if len(given) != len(base):
        raise ValueError(f"convert: --param-groups gives {len(given)} param group(s); {ckpt.tag_dir} has {len(base)}")
    return dict(given[g])


def group_filler(plans, shapes, stage: int, dp: int):
    """`fill(rank)` for write_rank_files: each group's plan (eight_bit, key classes, templates, hyper-parameters,
    per-parameter bnb state, per-parameter fp32 weights) laid out as `rank`'s partition at `dp` ranks and `stage`."""
    def fill(rank):
        groups = []
        for (eight_bit, key_classes, templates, hyperparams, per_param, master), group_shapes in zip(plans, shapes):
            layout = (ShardedLayout if stage == 3 else GroupLayout)(
                tuple(shape.numel() for shape in group_shapes.values()), dp)
            record = empty_group_record(layout, rank, list(group_shapes), eight_bit, key_classes, templates,
                                        hyperparams)
            scatter_param_states(record.layout, eight_bit, key_classes, per_param, rank, record.state)
            for seg in record.layout.segments(rank, eight_bit):
                record.master.narrow(0, seg.offset, seg.numel).copy_(master[seg.slot].narrow(0, seg.param_start,
                                                                                            seg.numel))
            groups.append(record)
        return groups
    return fill


def round_trip(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor
               ) -> Tuple[float, float]:
    """(largest |dequantized - original| as a fraction of the gap between the two codes around the original, the
    largest |dequantized - original| itself), from one dequantization."""
    error = (dequantize_blockwise(codes, absmax, qmap) - values).abs()
    if not error.numel():
        return 0.0, 0.0
    gap = code_gap(values, absmax, qmap)
    ratio = torch.where(gap > 0, error / gap, torch.where(error > 0, torch.inf, 0.0))
    return float(ratio.max()), float(error.max())


def step_ratio(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> float:
    """Largest |dequantized - original| as a fraction of the gap between the two codes around the original."""
    return round_trip(values, codes, absmax, qmap)[0]


def switch_master_weights(path: str, out_dir: str, mode: str, progress: bool = True) -> str:
    """Write deepspeed_bnb checkpoint `path` into `out_dir` with master weights `mode` ("fp32", "bf16" or "bf16+8"),
    everything else unchanged (same DP size, stage and optimizer state); returns a report line saying how many
    weights the switch rounded (none from bf16 to either other mode, or from bf16+8 to fp32)."""
    master_weights.check_mode(mode, "convert --master-weights")
    ckpt = SavedCheckpoint(path, verify_checksums=True)
    if not ckpt.is_deepspeed_bnb:
        raise CheckpointMismatchError(f"{ckpt.tag_dir} is a stock DeepSpeed checkpoint: convert it with --to 8bit "
                                      f"(and --master-weights {mode}) first.")
    ckpt.refuse_model_parallel("deepspeed-bnb convert --master-weights")
    source = source_master_mode(ckpt)
    rounded, total, largest = 0, 0, 0.0
    for g in range(len(ckpt.groups)):
        for w in ckpt.master_weights(g):
            w = w.detach().float()
            held = master_weights.representable(w, mode)
            changed = held != w
            rounded, total = rounded + int(changed.sum()), total + w.numel()
            if bool(changed.any()):
                relative = ((held - w).abs() / w.abs())[changed & (w != 0)]
                largest = max(largest, float(relative.max()) if relative.numel() else 0.0)
    written = reshape(path, out_dir, ckpt.dp, progress, ckpt.zero_stage, allow_large_dp=True, master_mode=mode)
    return (f"wrote {written}: master weights {source} -> {mode}; {rounded:,} of {total:,} weights rounded"
            + (f" (largest relative change {largest:.3g})" if rounded else " (exact)"))


def convert(path: str, out_dir: str, to: str, optimizer_class=None, min_8bit_size: int = 4096,
            progress: bool = True, dp: Optional[int] = None, stage: Optional[int] = None,
            allow_large_dp: bool = False, master_mode: Optional[str] = None,
            param_groups: Optional[List[dict]] = None, default_param_groups: Optional[List[dict]] = None,
            eight_bit_by_name: Optional[Dict[str, bool]] = None) -> str:
    """Write checkpoint `path` with `to` state precision into `out_dir`; returns a report line. `dp` / `stage`: the
    files to write for a universal checkpoint (which has neither; default 1 and 2); other inputs keep theirs (reshape
    changes them). `master_mode`: the master weights to write (default: the source's; fp32 for stock sources).
    `param_groups`: each param group's hyper-parameters, for an elastic stock checkpoint (which keeps none; refused
    for any other source); `default_param_groups`: the same where the source is an elastic stock one, ignored
    otherwise (a live engine's own, when it converts at load: runtime/converted_load.py). `eight_bit_by_name`: which
    parameters get 8-bit state with `to` "8bit" (a live engine's, its bnb overrides included); the others, and every
    parameter by default, by `min_8bit_size`."""
    if master_mode is not None:
        master_weights.check_mode(master_mode, "convert --master-weights")
    if to not in DEFAULT_CLASS:
        raise ValueError(f"convert: --to must be one of {sorted(DEFAULT_CLASS)}, got {to!r}")
    if min_8bit_size < 0:
        raise ValueError(f"convert: --min-8bit-size must be 0 or more elements (bnb's min_8bit_size), got "
                         f"{min_8bit_size}")
    if isinstance(optimizer_class, type):  # a live engine's own class (runtime/universal_load.py), not a name typed in
        cls, target = optimizer_class, f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    else:
        target = optimizer_class or DEFAULT_CLASS[to]
        cls = _load_class(target)
    universal = universal_tag_dir(path) is not None
    if (dp is not None or stage is not None) and not universal:
        raise ValueError("convert: --dp and --stage apply to universal (and --from-bnb) inputs, which have no DP size "
                         "or stage of their own; `deepspeed-bnb reshape` changes those of a ZeRO checkpoint")
    if dp is not None:
        check_dp("convert", dp, allow_large_dp)
    if stage is not None and stage not in (1, 2, 3):
        raise ValueError(f"convert: --stage must be 1, 2 or 3 (a ZeRO stage), got {stage}")
    ckpt = UniversalCheckpoint(path, dp or 1, stage or 2) if universal else SavedCheckpoint(path, verify_checksums=True)
    check_output(ckpt, out_dir)
    if not universal:
        ckpt.refuse_model_parallel("deepspeed-bnb convert")
    ours = ckpt.is_deepspeed_bnb
    if ours:
        ckpt.refuse_experts("deepspeed-bnb convert")
    if not ours and not universal and ckpt.zero_stage == 3:
        ckpt = StockZero3(ckpt)  # per param group, its sub-groups joined
    elastic_stock = not (ours or universal or isinstance(ckpt, StockZero3)) and \
        not isinstance(ckpt.optimizer_state(0)[BASE_OPTIMIZER_STATE], dict)  # keeps no param groups
    if param_groups is not None and not elastic_stock:
        raise ValueError(f"convert: --param-groups is for elastic stock ZeRO-1/2 checkpoints, which keep no hyper-"
                         f"parameters; {path} holds each param group's own (they are used)")
    if param_groups is None and elastic_stock:
        param_groups = default_param_groups
    if eight_bit_by_name:
        unknown = sorted(set(eight_bit_by_name) - {name for group in ckpt.param_shapes() for name in group})
        if unknown:
            raise ValueError(f"convert: a state precision was given for {unknown[:5]}, which are not trained "
                             f"parameters of {path}; name them as the checkpoint does (--32bit-params), e.g. "
                             f"{next(iter(ckpt.param_shapes()[0]), '?')!r}")
    plans, shapes, rule, report = plans_for(ckpt, cls, target, to, min_8bit_size, universal, ours, progress,
                                            param_groups, eight_bit_by_name)
    fill = group_filler(plans, shapes, ckpt.zero_stage, ckpt.dp)

    written = write_rank_files(ckpt, out_dir, ckpt.dp, fill, f"{cls.__module__}.{cls.__qualname__}", rule, progress,
                               master_mode=master_mode)
    kept = f", {report['kept']} kept as saved, bit for bit" if report["kept"] else ""
    return (f"wrote {written}: {report['params']} parameters for {target} ({report['8bit']} with 8-bit state, "
            f"{report['fp32']} fp32{kept}); round-trip error of the quantized moments: max "
            f"{report['worst_abs_error']:.3g} absolute, {report['worst_step_ratio']:.3f} of one quantization step")


def _requantized(value: torch.Tensor, qmap: Optional[torch.Tensor], report: dict):
    """(codes, absmax) of one row's fp32 `value` quantized with `qmap`, its round-trip error counted in `report`; with
    no map (32-bit state), (a copy of the values, None)."""
    if qmap is None:
        return value.clone(), None
    codes, absmax = quantize_blockwise(value, qmap)
    ratio, error = round_trip(value, codes, absmax, qmap)
    report["worst_step_ratio"] = max(report["worst_step_ratio"], ratio)
    report["worst_abs_error"] = max(report["worst_abs_error"], error)
    return codes, absmax


def plans_for(ckpt, cls, target: str, to: str, min_8bit_size: int, universal: bool, ours: bool, progress: bool,
              param_groups: Optional[List[dict]] = None, eight_bit_by_name: Optional[Dict[str, bool]] = None):
    """Per param group of `ckpt`: (eight_bit, key classes, templates, hyper-parameters, per-parameter state, master
    weights) for target class `cls` at precision `to`; with the shapes, bnb's update rule and the report's counts.
    `param_groups`: the groups' hyper-parameters where an elastic stock source keeps none (convert)."""
    shapes = ckpt.param_shapes()
    report = {"params": 0, "8bit": 0, "fp32": 0, "kept": 0, "worst_step_ratio": 0.0, "worst_abs_error": 0.0}

    plans = []  # per group: eight_bit, key classes, templates, hyper-parameters, per-parameter state, master
    for g, group_shapes in enumerate(shapes):
        if universal or ours or isinstance(ckpt, StockZero3):
            master = ckpt.master_weights(g)
            hyper = ckpt.groups[g][C.HYPERPARAMS_KEY] if ours else ckpt.hyperparams(g)
        else:
            master, hyper = stock_master_weights(ckpt, g), _stock_hyperparams(ckpt, g, param_groups)
        optimizer = _build(cls, target, hyper, to)
        rule = getattr(optimizer, "optimizer_name", None)
        layout = key_rows(rule)  # the state the target keeps, by bnb key and torch's row names: the source must hold it
        carries_over = universal and ckpt.optimizer_name == rule  # an 8-bit universal source of the same rule
        if layout is None and not carries_over:
            raise ValueError(f"convert: {target}'s update rule '{rule}' keeps state convert does not know (it writes "
                             f"Adam's, AdEMAMix's, Lion's, SGD's, RMSprop's and Adagrad's).")
        unkept = {k: what for k, what in TORCH_VARIANTS.items() if hyper.get(k)}
        if hyper.get("decoupled_weight_decay") is False and hyper.get("weight_decay"):  # torch's Adam, not AdamW
            unkept["weight_decay"] = "weight decay added to the gradient (bnb decays the weights, as AdamW does)"
        if hyper.get("bias_correction") is False:  # DeepSpeed's FusedAdam / DeepSpeedCPUAdam can turn it off
            unkept["bias_correction"] = "no bias correction (bnb's Adam rules always correct)"
        if unkept:
            raise ValueError(f"convert: param group {g} of {ckpt.tag_dir} steps with {unkept}, which "
                             f"{target} does not, so the run would go on under another rule. Keep that run's "
                             f"optimizer, or load its weights only (load_optimizer_states=False) and train on.")
        if universal:  # moments read below, only for what an 8-bit universal source does not carry over as it is
            moments = None
        elif ours:
            moments = _moments_of_record(ckpt, g, layout)
        else:
            moments = (ckpt.moments(g, layout) if isinstance(ckpt, StockZero3) else
                       _moments_of_stock(ckpt, g, layout))
        group = optimizer.param_groups[0]
        hyperparams = {**{k: v for k, v in group.items() if k != "params"},
                       **{k: v for k, v in hyper.items() if k in group or k == "initial_lr"}}
        from deepspeed_bnb.optim.bnb_adapter import BnbAdapter  # the live driver probes the target class's keys
        adapter = BnbAdapter(optimizer, ("qmap1", "qmap2"), BLOCK_SIZE)
        can_8bit = optimizer.args.optim_bits == 8
        known = eight_bit_by_name or {}
        eight_bit = [to == "8bit" and can_8bit and known.get(name, uses_8bit_state(shape.numel(), 8, min_8bit_size))
                     for name, shape in group_shapes.items()]
        if to == "8bit" and not can_8bit:
            raise ValueError(f"convert --to 8bit: {target} keeps 32-bit state; pass an 8-bit class such as "
                             f"{DEFAULT_CLASS['8bit']}")
        key_classes, templates = adapter.flat_keys(group, 0, eight_bit, "cpu")
        per_param = []
        qmaps = {name: templates[name] for name in ("qmap1", "qmap2") if name in templates}
        # an 8-bit universal source of the same update rule: each parameter's state as saved, where the target holds
        # it at the same precision with the same maps (bit for bit; anything else goes through its moments)
        saved = ckpt.param_states(g) if carries_over else [None] * len(eight_bit)
        kept = [state is not None and state.eight_bit == is8 and set(state) == key_classes.held(is8) and all(
            torch.equal(state[name], qmap) for name, qmap in qmaps.items() if name in state)
            for state, is8 in zip(saved, eight_bit)]
        if moments is None:
            moments = ([(None, None)] * len(kept) if all(kept) else
                       ckpt.moments(g, saved if carries_over else None, layout))
        for (values, step), is8, state, keep in tqdm(list(zip(moments, eight_bit, saved, kept)), desc=f"group {g}",
                                                   disable=not progress):
            report["params"] += 1
            report["8bit" if is8 else "fp32"] += 1
            if keep:
                per_param.append(state)
                report["kept"] += 1
                continue
            state = {"step": step}
            values = iter(values)  # row_names(layout) order: each key's rows in turn
            for i, (key, names) in enumerate(layout, start=1):
                # a key of several rows (AdEMAMix's state1) is (rows, numel), each row's blocks from its own start
                held = [_requantized(next(values).reshape(-1).float(), qmaps.get(f"qmap{i}") if is8 else None, report)
                        for _ in names]
                if is8:
                    state[f"qmap{i}"] = qmaps[f"qmap{i}"]
                    state[f"absmax{i}"] = torch.stack([absmax for _, absmax in held]) if len(held) > 1 else held[0][1]
                state[key] = torch.stack([codes for codes, _ in held]) if len(held) > 1 else held[0][0]
            per_param.append(state)
        plans.append((eight_bit, key_classes, templates, hyperparams, per_param, master))

    return plans, shapes, rule, report
