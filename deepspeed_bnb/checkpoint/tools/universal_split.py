"""A universal checkpoint cut for the model-parallel ranks of a loading engine: each rank's parameters (its pipeline
stage's layers) with each tensor-parallel parameter sliced along its dimension, written as one tag of that engine's
layout (one set of files per model-parallel rank), which the engine then loads the ordinary way.

The inverse of format/merged.py: a checkpoint joined at one tensor/pipeline-parallel size (or saved without either)
is loaded at another. Slices of whole 256-element blocks keep the 8-bit codes and block scales as they are; a cut
inside a block (a row-parallel weight's slices along dim 1, an uneven vocabulary split) requantizes that slice from its
dequantized values, counted for the report. A layout the checkpoint cannot be cut into (a parameter it lacks, a
dimension the slices do not add up to, parameter groups that do not correspond) is refused before anything is
written, naming the parameter.
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Sequence, Tuple

import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.model_parallel import ModelParallelPlace, split_of
from deepspeed_bnb.checkpoint.format.weights import FROZEN_FRAGMENTS, FROZEN_SHAPES, frozen_weights
from deepspeed_bnb.checkpoint.tools.convert import group_filler, plans_for
from deepspeed_bnb.checkpoint.tools.rank_files import write_model_parallel_files
from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint
from deepspeed_bnb.optim.param_state import ParamState, Requantization
from deepspeed_bnb.optim.state_names import ADAM_ROWS, KeyRows


@dataclass(frozen=True)
class RankLayout:
    """What one model-parallel rank of the loading engine holds."""

    place: ModelParallelPlace  # its tensor-parallel rank and stage, each parameter's split
    shapes: Tuple[Dict[str, Tuple[int, ...]], ...]  # per param group: its parameters' local shapes, in flat order
    starts: Dict[str, int]  # per sliced parameter (trained or frozen): where its slice starts along the split dimension
    frozen: Dict[str, Tuple[int, ...]] = field(default_factory=dict)  # its frozen parameters' local shapes
    buffers: Tuple[str, ...] = ()  # its module's persistent buffers (every tensor-parallel rank holds them whole)
    eight_bit: Dict[str, bool] = field(default_factory=dict)  # its parameters' state precision, bnb overrides
    # included (the engine's); a parameter not named here: by min_8bit_size


Shapes = Dict[str, Tuple[int, ...]]  # parameter name -> shape


def rank_layouts(held: Sequence[Tuple[ModelParallelPlace, Sequence[Shapes], Shapes, Sequence[str]]]) \
        -> List[RankLayout]:
    """Every model-parallel rank's layout, in model-parallel rank order, from each rank's (place, local shapes per
    param group, frozen parameters' local shapes, buffer names): a slice starts where the slices of the lower
    tensor-parallel ranks of its stage end (AutoTP's uneven vocabulary split included)."""
    by_place = {(place.pp_stage, place.tp_rank): [*shapes, frozen] for place, shapes, frozen, _ in held}
    layouts = []
    for place, shapes, frozen, buffers in held:
        starts = {}
        for group in [*shapes, frozen]:
            for name in group:
                split = split_of(place, name, f"model-parallel rank ({place.pp_stage}, {place.tp_rank})")
                if isinstance(split, int):
                    starts[name] = sum(_find(by_place[(place.pp_stage, t)], name)[split] for t in range(place.tp_rank))
        layouts.append(RankLayout(place, tuple(dict(g) for g in shapes), starts, dict(frozen), tuple(buffers)))
    return layouts


def _find(shapes, name):
    return next(group[name] for group in shapes if name in group)


class ModelRankUniversal:
    """A UniversalCheckpoint as one model-parallel rank of the loading engine sees it: what `convert` reads of a
    source (param_shapes, master_weights, param_states, moments, hyperparams), for that rank's parameters only, cut
    to its slices; everything else the universal checkpoint's."""

    def __init__(self, universal: UniversalCheckpoint, layout: RankLayout, requantized: Requantization):
        self.universal, self.layout, self.place = universal, layout, layout.place
        self.requantized = requantized
        full = universal.param_shapes()
        where = f"{universal.tag_dir} loaded at model-parallel rank (stage {self.place.pp_stage}, tensor-parallel " \
                f"rank {self.place.tp_rank})"
        if len(layout.shapes) != len(full):
            raise CheckpointMismatchError(f"{where}: the engine has {len(layout.shapes)} param groups, the checkpoint "
                                          f"{len(full)}; its groups cannot be matched to the engine's.")
        self._index = {}  # name -> (index in its universal group, full shape, split dim or None, this rank's shape)
        for g, group in enumerate(layout.shapes):
            position = {name: i for i, name in enumerate(full[g])}
            for name, local in group.items():
                if name not in full[g]:
                    raise CheckpointMismatchError(f"{where}: parameter {name!r} (param group {g}) is not in the "
                                                  f"checkpoint; it is of another model.")
                self._index[name] = (position[name], *self._cut(name, tuple(full[g][name]), local, where))
        # The frozen parameters the checkpoint holds (whole; one saved with exclude_frozen_parameters holds none, and
        # the engine keeps its own values of those, as a load at model-parallel size 1 does) and the buffers
        self._frozen = {name: weights for name, weights in frozen_weights(universal).items() if name in layout.frozen}
        for name, weights in self._frozen.items():
            self._index[name] = (None, *self._cut(name, tuple(weights.shape), layout.frozen[name], where))
        self._groups: Dict[int, Tuple[List[torch.Tensor], List[ParamState]]] = {}

    def _cut(self, name: str, whole: Tuple[int, ...], local: Tuple[int, ...], where: str):
        """(whole shape, split dim or None, this rank's shape) of parameter `name`: this rank's shape checked to be a
        slice of the checkpoint's along its split."""
        split = split_of(self.place, name, where)
        if isinstance(split, str):
            raise CheckpointMismatchError(f"{where}: parameter {name!r} cannot be sliced: {split}.")
        expected = list(whole)
        if split is not None:
            if split >= len(whole) or self.layout.starts[name] + local[split] > whole[split]:
                raise CheckpointMismatchError(
                    f"{where}: parameter {name!r} of shape {whole} cannot give this rank the slice {tuple(local)} "
                    f"along dimension {split} from index {self.layout.starts.get(name)}: the tensor-parallel size "
                    f"does not divide it as the engine does.")
            expected[split] = local[split]
        if tuple(expected) != tuple(local):
            raise CheckpointMismatchError(f"{where}: parameter {name!r} is {whole} in the checkpoint; this rank holds "
                                          f"it as {tuple(local)}, not a slice of it.")
        return whole, split, tuple(local)

    def __getattr__(self, name):
        return getattr(self.universal, name)

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        return [{name: torch.Size(shape) for name, shape in group.items()} for group in self.layout.shapes]

    @cached_property  # read by several writers' steps; the frozen slices are cut once
    def model_states(self) -> dict:
        """The universal checkpoint's model states for this rank: its parameters and their slices' shapes, its
        buffers, its slices of the frozen parameters (in `module` and as the fragments a ZeRO-2 save writes)."""
        states = {k: v for k, v in self.universal.model_states.items() if k not in (FROZEN_SHAPES, FROZEN_FRAGMENTS)}
        held = self.universal.model_states.get("module") or {}
        buffers = {name: held[name] for name in self.layout.buffers if name in held}
        frozen = {name: self._slice(name, weights.reshape(-1)).reshape(self.layout.frozen[name])
                  for name, weights in self._frozen.items()}
        states.update(module={**buffers, **frozen}, buffer_names=list(buffers), param_shapes=self.param_shapes())
        if frozen:
            states.update({FROZEN_SHAPES: {name: weights.shape for name, weights in frozen.items()},
                           FROZEN_FRAGMENTS: frozen})
        return states

    def _slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        _, whole, split, local = self._index[name]
        if split is None:
            return tensor
        return tensor.reshape(*tensor.shape[:-1], *whole).narrow(tensor.dim() - 1 + split, self.layout.starts[name],
                                                                 local[split]).reshape(*tensor.shape[:-1], -1)

    def _full(self, g: int):
        if g not in self._groups:
            states = self.universal.param_states(g) if self.universal.bnb else None
            self._groups[g] = (self.universal.master_weights(g), states)
        return self._groups[g]

    def master_weights(self, g: int) -> List[torch.Tensor]:
        masters = self._full(g)[0]
        return [self._slice(name, masters[self._index[name][0]]) for name in self.layout.shapes[g]]

    def param_states(self, g: int) -> List[ParamState]:
        states = self._full(g)[1]
        if states is None:
            return self.universal.param_states(g)  # raises: the fp32 kinds hold no bnb state
        out = []
        for name in self.layout.shapes[g]:
            i, whole, split, local = self._index[name]
            state = states[i]
            if split is not None:
                state = state.slice(whole, split, self.layout.starts[name], local[split], self.requantized, what=name)
            out.append(state)
        return out

    def moments(self, g: int, states=None, rows: KeyRows = ADAM_ROWS):
        if states is not None or self.universal.bnb:
            return self.universal.moments(g, states if states is not None else self.param_states(g), rows)
        full = self.universal.moments(g, None, rows)
        return [([self._slice(name, row) for row in full[self._index[name][0]][0]], full[self._index[name][0]][1])
                for name in self.layout.shapes[g]]


def convert_for_model_parallel(path: str, out_dir: str, layouts: Sequence[RankLayout], optimizer_class: type,
                               min_8bit_size: int, stage: int, progress: bool = False) -> str:
    """Write the universal checkpoint `path` into `out_dir` as one tag for an engine of `layouts` (one per
    model-parallel rank) at data-parallel size 1 and ZeRO `stage`, 8-bit state for `optimizer_class`; returns a report
    line (what slicing requantized)."""
    universal = UniversalCheckpoint(path, 1, stage)
    target = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    requantized = Requantization()
    views = [ModelRankUniversal(universal, layout, requantized) for layout in layouts]  # every layout checked first
    ranks, rule = [], None
    for view, layout in zip(views, layouts):
        plans, shapes, rule, _ = plans_for(view, optimizer_class, target, "8bit", min_8bit_size, True, False,
                                           progress, eight_bit_by_name=layout.eight_bit)
        ranks.append((view, group_filler(plans, shapes, stage, 1)))
    written = write_model_parallel_files(ranks, out_dir, 1, target, rule, progress, stage)
    return f"wrote {written} for {len(layouts)} model-parallel ranks: {requantized}"
