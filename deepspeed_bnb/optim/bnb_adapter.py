"""Drives a bitsandbytes optimizer's own `init_state`/`update_step` on block-aligned segments of a ZeRO partition.

The bnb optimizer the user built keeps doing the arithmetic: for each segment (the part of one model parameter a rank
owns) it gets a parameter view, a gradient view and a state dict of views into the partition's flat state, and its
`update_step` runs unchanged. Because segments start on block boundaries, this is bit-identical to plain bnb on the
whole parameter. What bnb would decide per tensor from the tensor it is handed (8-bit or fp32 state, per-parameter
config overrides) is decided here per *model* parameter, once, before ZeRO replaces the param lists.
"""

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from deepspeed_bnb.ops import bnb_update, compensated
from deepspeed_bnb.optim import batched_update
from deepspeed_bnb.optim.flat_state import FlatKeys, stored_name
from deepspeed_bnb.optim.grad_mode import without_grad
from deepspeed_bnb.optim.state_classes import StateClass, StateClassError, classify
from deepspeed_bnb.state_layout import BLOCK_SIZE, Segment, split_segment, uses_8bit_state

if TYPE_CHECKING:
    from bitsandbytes.optim.optimizer import Optimizer8bit

# elements of compensated master weights widened to fp32 at a time (with their gradient: 32 MiB of scratch)
COMPENSATED_PIECE = 1 << 22
PROBE_NUMEL = 3 * BLOCK_SIZE  # > 1 block, so element-, block- and 256-entry-shaped tensors all differ
BNB_OPTIMIZER_MODULE = "bitsandbytes.optim.optimizer"  # defines Optimizer8bit, the base of every bnb optimizer


@dataclass(frozen=True)
class StateKey:
    """How one bnb state key is stored in a partition's flat state."""

    name: str  # bnb's key: state1, absmax1, qmap1, step, ...
    stored_as: str  # key in the flat state: `name`, or FP32_PREFIX + name for fp32-precision segments
    cls: StateClass  # how it is partitioned, saved and resharded
    eight_bit: bool  # the precision whose segments use it
    template: object  # what bnb created for the probe: tensor (dtype, leading rows, whole value) or scalar


def model_numel(param: torch.Tensor) -> int:
    """Elements of a model parameter, also when ZeRO-3 has partitioned it (its `.data` is then empty: `ds_numel`)."""
    return int(getattr(param, "ds_numel", param.numel()))


class _NoOverrides:
    """Stands in for bnb's GlobalOptimManager once overrides are resolved per model parameter.

    bnb looks overrides up by (group index, position in the group); under ZeRO each group holds a single flat
    partition, so those positions no longer name the parameters the user configured.
    """

    index2config: dict = {}
    pid2config: dict = {}
    module_weight_config_triple: list = []
    uses_config_override = False


# Options of bitsandbytes 0.49 (0.50 removed them) under which bnb's update reads statistics of the whole parameter
# tensor: percentile_clipping < 100 clips by a history of its gradient norms (state "gnorm_vec"), block_wise=False
# quantizes 8-bit state with one scale per tensor ("max1", "new_max1"). A ZeRO segment holds part of a tensor, and
# the fused kernels implement neither, so such a parameter would silently get another update than plain bnb's.
WHOLE_TENSOR_OPTIONS = {"percentile_clipping": 100, "block_wise": True}  # option -> the only value supported


def _refuse_whole_tensor_options(optimizer, config: dict, gindex: int, pindex: int, eight_bit: bool) -> None:
    for option, supported in WHOLE_TENSOR_OPTIONS.items():
        if option in config and config[option] != supported and (eight_bit or option != "block_wise"):
            raise NotImplementedError(
                f"deepspeed_bnb: {type(optimizer).__name__} uses {option}={config[option]!r} for parameter {pindex} of "
                f"param group {gindex}; bitsandbytes computes it over the whole parameter tensor, which ZeRO splits "
                f"into segments. Build the optimizer with {option}={supported!r} (bitsandbytes' default; 0.50 "
                f"removed the option).")


def _refuse_split_trust_ratio(optimizer, param, name: str, eight_bit: bool, max_unorm: float) -> None:
    """bnb's update is called on pieces of at most bnb_update.MAX_UPDATE_NUMEL elements; a per-tensor trust ratio
    (max_unorm > 0 on 32-bit state) would be computed per piece, i.e. not bnb's."""
    numel = model_numel(param)
    if not eight_bit and max_unorm > 0 and numel > bnb_update.MAX_UPDATE_NUMEL:
        raise NotImplementedError(
            f"deepspeed_bnb: parameter {name} has {numel:,} elements, 32-bit state and a per-tensor trust ratio "
            f"(max_unorm={max_unorm}) under {type(optimizer).__name__}; bitsandbytes' update counts elements in 32 "
            f"bits, so deepspeed_bnb steps tensors of more than {bnb_update.MAX_UPDATE_NUMEL:,} elements in pieces, "
            f"and a trust ratio needs the whole tensor in one call. Give it 8-bit state (optim_bits=8 and a "
            f"min_8bit_size below its size) or max_unorm=0.")


class BnbAdapter:
    """Per-parameter precision and config of one bnb optimizer, and its update run segment by segment."""

    def __init__(self, optimizer: "Optimizer8bit", keep_whole: Iterable[str], keep_whole_threshold: int,
                 param_names: Optional[Mapping] = None):
        """`param_names`: the engine's {model parameter: name} (what DeepSpeed hands its ZeRO optimizers), to name
        parameters in errors; without it, DeepSpeed's process-wide debug map (deepspeed.utils.debug)."""
        self.optimizer = optimizer
        self.optimizer_name = optimizer.optimizer_name
        self.keep_whole = frozenset(keep_whole)
        self.keep_whole_threshold = int(keep_whole_threshold)
        self._overrides: Dict[int, dict] = {}  # id(model parameter) -> bnb config overrides for it
        self._eight_bit: Dict[int, bool] = {}  # id(model parameter) -> uses 8-bit state
        self._max_unorm: Dict[int, float] = {}  # id(model parameter) -> LAMB/LARS trust-ratio bound
        # per bnb param group: (override, 8-bit?, name) of each model parameter, to name parameters in errors
        self._described: Dict[int, List[tuple]] = {}
        self.device: Optional[torch.device] = None  # where the partition state lives (allocate): bnb's update runs

        optimizer.check_overrides()  # bnb resolves `register_module_override` lazily, at its first step()
        manager = optimizer.mng
        for gindex, group in enumerate(optimizer.param_groups):
            for pindex, p in enumerate(group["params"]):
                # bnb's own get_config decides which registered overrides apply to the parameter (bitsandbytes 0.49
                # looks up `index2config` only; 0.50 falls back to `pid2config`, i.e. `override_config` made after
                # `register_parameters`): the override is what it changes, so ZeRO follows the installed release.
                config = optimizer.get_config(gindex, pindex, group)
                optimizer.mng = _NoOverrides()
                try:
                    plain = optimizer.get_config(gindex, pindex, group)
                finally:
                    optimizer.mng = manager
                self._overrides[id(p)] = {k: v for k, v in config.items() if k not in plain or plain[k] != v}
                self._eight_bit[id(p)] = uses_8bit_state(model_numel(p), config["optim_bits"], config["min_8bit_size"])
                self._max_unorm[id(p)] = float(config.get("max_unorm", 0.0))
                name = _param_name(p, f"#{pindex} of param group {gindex}", param_names)
                self._described.setdefault(gindex, []).append((self._overrides[id(p)], self._eight_bit[id(p)], name))
                _refuse_whole_tensor_options(optimizer, config, gindex, pindex, self._eight_bit[id(p)])
                _refuse_split_trust_ratio(optimizer, p, name, self._eight_bit[id(p)], self._max_unorm[id(p)])
        optimizer.initialized = True  # bnb's step() would re-run check_overrides/to_gpu; it is never called now
        optimizer.mng = _NoOverrides()
        self._bnb_get_config = optimizer.get_config
        self._current_override: dict = {}
        optimizer.get_config = self._get_config  # instance attribute: bnb's init_state/update_step call it
        self._specs: Dict[bool, List[StateKey]] = {}
        self._scratch: Dict[bool, Dict[str, torch.Tensor]] = {}  # precision -> bnb's scratch keys (never stored)

    def _get_config(self, gindex, pindex, group):
        config = self._bnb_get_config(gindex, pindex, group)
        config.update(self._current_override)
        return config

    def config(self, group: dict, gindex: int, override: dict) -> dict:
        """What bnb's get_config gives a parameter of `group` with these per-parameter overrides (a subclass's own
        get_config included): every field its update_step reads."""
        config = self._bnb_get_config(gindex, 0, group)
        config.update(override)
        return config

    def eight_bit(self, param: torch.Tensor) -> bool:
        return self._eight_bit[id(param)]

    def override(self, param: torch.Tensor) -> dict:
        return self._overrides[id(param)]

    def max_unorm(self, param: torch.Tensor) -> float:
        return self._max_unorm[id(param)]

    def eight_bit_by_name(self) -> Dict[str, bool]:
        """Model parameter name -> uses 8-bit state, for every parameter whose name is known (bnb's per-parameter
        overrides included: HF Trainer keeps embeddings in 32-bit state with one)."""
        return {name: eight_bit for described in self._described.values() for _, eight_bit, name in described
                if not name.startswith("#")}

    def names(self, gindex: int, override: dict, eight_bit: bool) -> List[str]:
        """The model parameters of param group `gindex` with this override and precision (those that share a route)."""
        return [name for o, e, name in self._described.get(gindex, ()) if e == eight_bit and o == override]

    def state_keys(self, group: dict, gindex: int, eight_bit: bool, device) -> List[StateKey]:
        """The keys bnb creates for a parameter of this precision, classified (probed once per precision)."""
        if eight_bit not in self._specs:
            probe = torch.zeros(PROBE_NUMEL, dtype=torch.float32, device=device)
            # The override forces the precision bnb would pick for the real parameter: the probe itself is small.
            self._current_override = {"optim_bits": 8, "min_8bit_size": 0} if eight_bit else {"optim_bits": 32}
            try:
                self.optimizer.init_state(group, probe, gindex, 0)
            finally:
                self._current_override = {}
            created = self.optimizer.state.pop(probe)
            keys = []
            for name, value in created.items():
                cls = classify(name, value, PROBE_NUMEL, self.optimizer_name, self.keep_whole,
                               self.keep_whole_threshold)
                if cls == StateClass.BLOCK and not eight_bit:
                    raise StateClassError(f"optimizer state key {name!r} of fp32-state parameters is one value per "
                                          f"256-element block; deepspeed_bnb packs fp32 state without block "
                                          f"alignment and cannot partition it.")
                keys.append(StateKey(name=name, stored_as=stored_name(name, cls, eight_bit), cls=cls,
                                     eight_bit=eight_bit, template=value))
            self._specs[eight_bit] = keys
        return self._specs[eight_bit]

    def allocate(self, group: dict, gindex: int, segments: Sequence[Segment], partition_size: int,
                 group_eight_bit: Sequence[bool], device) -> dict:
        """Zero-initialised flat state for one partition, as bnb's init_state would leave each of its parameters.

        Every rank gets the keys of every precision present in the group (even with no segment of it: zero-length
        or unused tensors), so all ranks hold the same keys and whole tensors exist on rank 0 for checkpoints.
        """
        self.device = torch.device(device)
        keys, templates = self.flat_keys(group, gindex, group_eight_bit, device)
        for eight_bit in set(group_eight_bit):
            self._scratch[eight_bit] = {key.name: key.template.to(device) for key in self._specs[eight_bit]
                                        if key.cls == StateClass.SCRATCH}
        state = {"step": 0}  # a partition of pure padding still counts steps like its peers
        state.update(keys.zeros(templates, partition_size, sum(s.numel for s in segments if not s.eight_bit), device))
        return state

    def flat_keys(self, group: dict, gindex: int, eight_bit: Iterable[bool], device) -> Tuple[FlatKeys, dict]:
        """The keys a flat partition holds for parameters of the precisions in `eight_bit` (8-bit ones first), and
        bnb's probe tensor of each (rows, dtype, whole values): scratch keys are never stored."""
        classes, templates = {}, {}
        for precision in sorted(set(eight_bit), reverse=True):
            for key in self.state_keys(group, gindex, precision, device):
                if key.cls != StateClass.SCRATCH:
                    classes[key.stored_as], templates[key.stored_as] = key.cls, key.template
        return FlatKeys(classes), templates

    def stored_classes(self, state: dict) -> FlatKeys:
        """The keys of a flat state and their classes (SCRATCH keys are never stored)."""
        classes = {"step": StateClass.SCALAR}
        for keys in self._specs.values():
            for key in keys:
                if key.stored_as in state:
                    classes[key.stored_as] = key.cls
        return FlatKeys(classes)

    def _segment_state(self, keys: FlatKeys, state: dict, segment: Segment, step) -> dict:
        """bnb's state dict of one segment: views into the flat state (whose keys are `keys`), the step bnb's update
        reads, its scratch."""
        views = keys.views(state, segment)
        views["step"] = step
        views.update(self._scratch[segment.eight_bit])
        return views

    @without_grad
    def step(self, group: dict, gindex: int, params: torch.Tensor, grads: torch.Tensor, state: dict,
             segments: Sequence[Segment], overrides: Sequence[dict], error: Optional[torch.Tensor] = None,
             grad_scale: Optional[torch.Tensor] = None) -> None:
        """One bnb update of every segment of a flat partition, in place (padding is never touched). The master
        weights `params` are fp32 or bf16 (bnb steps either); with `error` (int8, compensated master weights:
        ops/compensated.py), bf16 plus that error term, which each piece is widened to fp32 with for bnb's update and
        split back into after it. Small 32-bit segments share one call where that gives the same bits
        (batched_update.py). `grad_scale`: a 0-dim tensor each segment's gradient is multiplied by first, as
        DeepSpeed's unscale/clip multiplies the partition's (in place; a batch's joined copy once)."""
        step = state["step"]
        if not segments:  # the kernel stepped every segment (or pure padding): only the partition's step advances
            state["step"] = step + 1
            return
        keys = self.stored_classes(state)  # once per step, not per segment
        # bnb counts elements in 32 bits; compensated pieces are widened to fp32 scratch
        piece = bnb_update.MAX_UPDATE_NUMEL if error is None else COMPENSATED_PIECE
        scalars = {"step": step + 1}  # what bnb's update_step leaves
        batching = batched_update.allowed(self.optimizer_name, params.device)
        trust_ratio: List[tuple] = []  # (override, whether its config bounds updates by a trust ratio), memoized

        def batchable(segment: Segment, override: dict) -> bool:
            if not batching or segment.eight_bit or segment.numel > batched_update.MAX_SEGMENT:
                return False
            known = next((bounded for o, bounded in trust_ratio if o == override), None)
            if known is None:
                known = float(self.config(group, gindex, override).get("max_unorm", 0.0)) > 0.0
                trust_ratio.append((override, known))
            return not known

        for run in batched_update.runs(segments, overrides, batchable, piece):
            if len(run) > 1:
                views = self._step_batch(group, gindex, params, grads, state, [segments[i] for i in run],
                                         overrides[run[0]], error, step, keys, grad_scale)
                eight_bit = False
            else:
                if grad_scale is not None:
                    grads.narrow(0, segments[run[0]].offset, segments[run[0]].numel).mul_(grad_scale)
                for segment in split_segment(segments[run[0]], piece):
                    p = params.narrow(0, segment.offset, segment.numel)
                    grad = grads.narrow(0, segment.offset, segment.numel)
                    hi = lo = None
                    if error is not None:
                        hi, lo = p, error.narrow(0, segment.offset, segment.numel)
                        p, grad = compensated.join(hi, lo), grad.float()
                    views = self._update(group, gindex, keys, state, segment, overrides[run[0]], p, grad, step)
                    if error is not None:
                        compensated.split_(p, hi, lo)
                eight_bit = segments[run[0]].eight_bit
            # every segment starts from the partition's scalars and applies the same update to them
            scalars = {k.stored_as: views[k.name] for k in self._specs[eight_bit] if k.cls == StateClass.SCALAR}
        state.update(scalars)

    def _update(self, group: dict, gindex: int, keys: FlatKeys, state: dict, segment: Segment, override: dict,
                p: torch.Tensor, grad: torch.Tensor, step) -> dict:
        """bnb's update_step of one parameter piece `p` (gradient `grad`) whose state is `segment`'s views; the
        views."""
        bnb_state = self.optimizer.state
        p.grad = grad
        views = bnb_state[p] = self._segment_state(keys, state, segment, step)
        self._current_override = override
        try:
            self.optimizer.update_step(group, p, gindex, 0)
        finally:
            self._current_override = {}
            del bnb_state[p]
        return views

    def _step_batch(self, group: dict, gindex: int, params: torch.Tensor, grads: torch.Tensor, state: dict,
                    run: Sequence[Segment], override: dict, error: Optional[torch.Tensor], step, keys: FlatKeys,
                    grad_scale: Optional[torch.Tensor] = None) -> dict:
        """One bnb update of 32-bit segments with adjacent packed state (batched_update.runs): their weights and
        gradients gathered, stepped as one piece, the weights put back; the views of the state. The gathers and the
        put-back are one indexed copy each (batched_update.positions), not one per segment."""
        where = batched_update.positions(run, params.device)
        p = params.index_select(0, where) if error is None else \
            compensated.join(params.index_select(0, where), error.index_select(0, where))
        grad = grads.index_select(0, where)
        if grad_scale is not None:  # the joined copy: the same products as each segment's, in one call
            grad.mul_(grad_scale)
        merged = Segment(slot=run[0].slot, param_start=0, numel=p.numel(), offset=run[0].offset, eight_bit=False,
                         fp32_offset=run[0].fp32_offset)
        views = self._update(group, gindex, keys, state, merged, override, p,
                             grad if error is None else grad.float(), step)
        if error is None:
            params.index_copy_(0, where, p)
        else:
            hi, lo = compensated.split(p)
            params.index_copy_(0, where, hi)
            error.index_copy_(0, where, lo)
        return views


def _param_name(param: torch.Tensor, fallback: str, names: Optional[Mapping] = None) -> str:
    """The model's name of a parameter: from the engine's own `names` where given, else from the map DeepSpeed's
    engine fills before it builds the optimizer (deepspeed.utils.debug); `fallback` outside an engine.

    The engine's own names come first because DeepSpeed's debug map is one per process, and every engine's
    destroy() clears it, from `__del__` too (DeepSpeed 0.19.8): an earlier engine that the garbage collector frees
    while a new one is being built empties the new engine's names, and errors then said "#1 of param group 0"."""
    if names is not None and param in names:
        return names[param]
    lookup = getattr(sys.modules.get("deepspeed.utils.debug"), "debug_param2name", None)
    name = lookup(param) if lookup is not None else "unknown"
    return fallback if name == "unknown" else name


def _optimizer8bit() -> Optional[type]:
    """bnb's Optimizer8bit if bitsandbytes is loaded, else None. Never imports bitsandbytes (about 2 s and a GPU
    probe): a bnb optimizer cannot exist before its module has been imported, so a process without one pays nothing."""
    module = sys.modules.get(BNB_OPTIMIZER_MODULE)
    return getattr(module, "Optimizer8bit", None)


def is_bnb_optimizer(optimizer: Optional[object]) -> bool:
    base = _optimizer8bit()
    return base is not None and isinstance(optimizer, base)


def check_steppable(optimizer) -> None:
    """Refuse an optimizer this package cannot step as its author wrote it: not a bitsandbytes optimizer, or one
    whose class overrides `step()` (under ZeRO bnb sees flat partitions, so the package calls `update_step` per
    parameter segment and never `step()`: an override would be skipped without a word)."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if not is_bnb_optimizer(optimizer):
        raise TypeError(f"deepspeed_bnb.BnbZeroOptimizer steps bitsandbytes optimizers (subclasses of "
                        f"bitsandbytes.optim.optimizer.Optimizer8bit); got {name}. deepspeed.initialize builds "
                        f"DeepSpeed's own ZeRO optimizer for other optimizers.")
    # torch.optim.Optimizer wraps each class's step() in a profiling hook on first instantiation: compare the
    # functions underneath
    step = inspect.unwrap(cls.step)
    if step is not inspect.unwrap(_optimizer8bit().step):
        raise TypeError(f"deepspeed_bnb: {name} overrides step() ({step.__module__}.{step.__qualname__}), which "
                        f"ZeRO never calls here: deepspeed_bnb runs bnb's init_state/update_step on each parameter's "
                        f"share of the flat ZeRO partition. Move the per-step logic into update_step (called once "
                        f"per parameter segment per step), or train without ZeRO.")
