"""A checkpoint of a tensor- or pipeline-parallel run read as one model: every model-parallel rank's files joined per
parameter, 8-bit state kept (what an 8-bit universal checkpoint is written from).

Each model-parallel rank's optimizer records carry its place (model_parallel.py): its pipeline stage, its
tensor-parallel rank and the dimension each parameter is split along. Pipeline stages hold different layers; their
param groups are joined name by name in stage order (a weight tied across stages, such as shared embeddings, is the
first stage's). Tensor-parallel slices are joined along their dimension with ParamState.join: where each slice is
whole quantization blocks (a cut along dim 0 of a weight whose slices are multiples of 256 elements) the 8-bit codes
and block scales move unchanged; where not (a cut along dim 1, an uneven vocabulary split) the 8-bit state is
requantized from its dequantized values, counted in `requantized` (blocks, largest change) for the report. A
parameter every tensor-parallel rank holds whole must be the same on every rank: a split nothing recorded would
otherwise be joined as rank 0's slice, so a difference is refused, naming the parameter.

It offers what the universal writer reads of a SavedCheckpoint (reader.py) of one rank: param_shapes, param_states,
master_weights, record(0), model_states; and the model's buffers and frozen parameters, joined the same way
(buffers_and_frozen, which reads one rank's from weights.py).
"""

from typing import Dict, List, Tuple

import torch

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.model_parallel import ModelParallelPlace, no_place_error, split_of
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.format.records import saved_place
from deepspeed_bnb.checkpoint.format.weights import buffer_weights, frozen_weights, module_tensors
from deepspeed_bnb.optim.param_state import ParamState, Requantization


def open_whole_model(path: str, verify_checksums: bool = True):
    """The checkpoint at `path` as one model (whole_model)."""
    return whole_model(SavedCheckpoint(path, verify_checksums))


def whole_model(first: SavedCheckpoint):
    """`first` (a tag read at model-parallel rank 0) as one model: itself where one model-parallel rank wrote the tag,
    else the ModelParallelCheckpoint joining them all."""
    return first if first.model_parallel == 1 else ModelParallelCheckpoint(first)


class ModelParallelCheckpoint:
    """Every model-parallel rank of one tag, joined per parameter (see the module's description)."""

    def __init__(self, first: SavedCheckpoint):
        """`first`: the tag read at model-parallel rank 0 (checked against its manifest: the others are read from the
        same verified files)."""
        self.tag_dir, self.manifest = first.tag_dir, first.manifest
        self.ranks = [first] + [SavedCheckpoint(first.tag_dir, mp_rank=r) for r in range(1, first.model_parallel)]
        self.source = first.source  # (ds_version where the model states lack it)
        self.requantized = Requantization()  # what joining tensor-parallel slices requantized
        self.places = [self._place(ckpt) for ckpt in self.ranks]
        # (stage, tensor-parallel rank) -> (its files, its place)
        self._at: Dict[Tuple[int, int], Tuple[SavedCheckpoint, ModelParallelPlace]] = {
            (place.pp_stage, place.tp_rank): (ckpt, place) for ckpt, place in zip(self.ranks, self.places)}
        tp, pp = self.places[0].tp_size, self.places[0].pp_size
        if (len(self.ranks) != tp * pp or len(self._at) != tp * pp
                or any((p.tp_size, p.pp_size) != (tp, pp) for p in self.places)):
            raise CheckpointMismatchError(
                f"{self.tag_dir}: its {len(self.ranks)} model-parallel ranks record the places "
                f"{[(p.pp_stage, p.tp_rank, p.pp_size, p.tp_size) for p in self.places]} (stage, tensor-parallel "
                f"rank, stages, tensor-parallel ranks), not each of {pp} stages x {tp} tensor-parallel ranks once: "
                f"files of several checkpoints were mixed.")
        self.tp_size, self.pp_size = tp, pp
        groups = {len(ckpt.groups) for ckpt in self.ranks}
        if len(groups) != 1:
            raise CheckpointMismatchError(f"{self.tag_dir}: its model-parallel ranks hold different numbers of param "
                                          f"groups ({sorted(groups)}); they cannot be joined group by group.")
        self._joined: Dict[int, Tuple[Dict[str, torch.Size], List[torch.Tensor], List[ParamState]]] = {}

    def _place(self, ckpt: SavedCheckpoint) -> ModelParallelPlace:
        if not ckpt.is_deepspeed_bnb:
            raise CheckpointMismatchError(f"{ckpt.source.name(0)} holds no deepspeed_bnb optimizer record; a stock "
                                          f"DeepSpeed model-parallel checkpoint is DeepSpeed's ds_to_universal's.")
        place = saved_place(ckpt.record(0), ckpt.source.name(0))
        if place is None:
            raise no_place_error(ckpt.source.name(0))
        return place

    # ---- what the writers read ----------------------------------------------------------------------------------

    @property
    def model_parallel(self) -> int:
        return len(self.ranks)

    @property
    def model_states(self) -> dict:
        return self.ranks[0].model_states

    @property
    def optimizer_class(self) -> str:
        return self.ranks[0].optimizer_class

    @property
    def is_deepspeed_bnb(self) -> bool:
        return True

    @property
    def groups(self) -> List[dict]:
        return self.ranks[0].groups

    def record(self, rank: int) -> dict:
        """A record of the first stage's first tensor-parallel rank (optimizer name, param groups' settings)."""
        return self._at[(0, 0)][0].record(rank)

    def refuse_experts(self, what: str) -> None:
        for ckpt in self.ranks:
            ckpt.refuse_experts(what)

    def refuse_model_parallel(self, what: str) -> None:
        self.ranks[0].refuse_model_parallel(what)

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        return [self._join(g)[0] for g in range(len(self.groups))]

    def master_weights(self, g: int) -> List[torch.Tensor]:
        return self._join(g)[1]

    def param_states(self, g: int) -> List[ParamState]:
        return self._join(g)[2]

    # ---- joining ------------------------------------------------------------------------------------------------

    def _join(self, g: int):
        if g not in self._joined:
            shapes: Dict[str, torch.Size] = {}
            masters: List[torch.Tensor] = []
            states: List[ParamState] = []
            for stage in range(self.pp_size):
                slices = [self._at[(stage, t)][0] for t in range(self.tp_size)]
                pieces = [(ckpt.param_shapes()[g], ckpt.master_weights(g), ckpt.param_states(g)) for ckpt in slices]
                names = list(pieces[0][0])
                if any(list(p[0]) != names for p in pieces):
                    raise CheckpointMismatchError(
                        f"{self.tag_dir}: pipeline stage {stage}'s tensor-parallel ranks name different parameters in "
                        f"param group {g}; their files are of different runs.")
                for i, name in enumerate(names):
                    if name in shapes:  # a weight tied across stages: the first stage's
                        continue
                    shapes[name], master, state = self._join_param(
                        name, stage, [(p[0][name], p[1][i], p[2][i]) for p in pieces])
                    masters.append(master)
                    states.append(state)
            self._joined[g] = (shapes, masters, states)
        return self._joined[g]

    def _join_param(self, name: str, stage: int, slices) -> Tuple[torch.Size, torch.Tensor, ParamState]:
        """(shape, flat fp32 master weights, state) of parameter `name` from its (shape, master, state) on each
        tensor-parallel rank of `stage`."""
        where = f"{self.tag_dir}, pipeline stage {stage}"
        split = self._split(name, stage, where)
        local = [tuple(s) for s, _, _ in slices]
        shape = _joined_shape(name, where, split, local, [m for _, m, _ in slices])
        if split is None:
            return shape, slices[0][1], slices[0][2]
        state = ParamState.join([s for _, _, s in slices], list(shape), split, self.requantized, what=name)
        master = torch.cat([m.reshape(s) for s, (_, m, _) in zip(local, slices)], dim=split).reshape(-1)
        return shape, master, state

    def _split(self, name: str, stage: int, where: str):
        """The recorded split of parameter `name` of `stage` (a pipeline's layer files hold every stage's layers: a
        frozen parameter read there may be another stage's), refused where it cannot be joined."""
        place = self._at[(stage, 0)][1]
        if name not in place.splits:
            place = next((other for other in self.places if name in other.splits), place)
        split = split_of(place, name, where)
        if isinstance(split, str):
            raise CheckpointMismatchError(f"{where}: parameter {name!r} cannot be joined across tensor-parallel "
                                          f"ranks: {split}.")
        return split

    def buffers_and_frozen(self) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        """The whole model's persistent buffers and frozen parameters (what the optimizer records do not hold), in
        their saved dtype: each stage's (a name two stages hold: the first stage's), a frozen parameter's
        tensor-parallel slices joined along its recorded split; a tensor every tensor-parallel rank holds whole (every
        buffer, a parameter of split None) must be the same on all of them."""
        trained = {name: tuple(shape) for ckpt in self.ranks for group in ckpt.param_shapes()
                   for name, shape in group.items()}
        buffer_names = list(dict.fromkeys(name for ckpt in self.ranks
                                          for name in ckpt.model_states.get("buffer_names") or []))
        known = {**{name: None for name in buffer_names}, **trained}
        layer_files: Dict[int, Dict[str, torch.Tensor]] = {}  # tensor-parallel rank -> a pipeline's (every stage's)

        def module(ckpt, t):  # the rank's module tensors; a pipeline's layer files read once per tensor-parallel rank
            if ckpt.model_states.get("module") is not None:
                return module_tensors(ckpt)
            if t not in layer_files:
                layer_files[t] = module_tensors(ckpt, t, known)
            return layer_files[t]

        buffers: Dict[str, torch.Tensor] = {}
        frozen: Dict[str, torch.Tensor] = {}
        for stage in range(self.pp_size):
            where = f"{self.tag_dir}, pipeline stage {stage}"
            ranks = [self._at[(stage, t)][0] for t in range(self.tp_size)]
            modules = [module(ckpt, t) for t, ckpt in enumerate(ranks)]
            for what, held, into in (
                    ("buffer", [buffer_weights(ckpt, buffer_names, m) for ckpt, m in zip(ranks, modules)], buffers),
                    ("frozen parameter", [frozen_weights(ckpt, trained, buffer_names, m)
                                          for ckpt, m in zip(ranks, modules)], frozen)):
                for name in held[0]:
                    if name in into:
                        continue
                    tensors = [h.get(name) for h in held]
                    if any(t is None for t in tensors):
                        raise CheckpointMismatchError(f"{where}: {what} {name!r} is missing on some of its "
                                                      f"tensor-parallel ranks; the files are of different runs.")
                    split = None if what == "buffer" else self._split(name, stage, where)
                    _joined_shape(name, where, split, [tuple(t.shape) for t in tensors], tensors)
                    into[name] = tensors[0] if split is None else torch.cat(tensors, dim=split)
        return buffers, frozen


def _joined_shape(name: str, where: str, split, local: List[tuple], tensors: List[torch.Tensor]) -> torch.Size:
    """The shape of tensor `name` joined from its tensor-parallel ranks' `tensors` of shapes `local` along `split`;
    where the split is None (held whole), every rank's copy must be rank 0's."""
    if split is None:
        for t, (shape, other) in enumerate(zip(local[1:], tensors[1:]), 1):
            if shape != local[0] or not torch.equal(other, tensors[0]):
                raise CheckpointMismatchError(
                    f"{where}: {name!r} is recorded as held whole by every tensor-parallel rank, but rank {t}'s copy "
                    f"differs from rank 0's ({shape} vs {local[0]}): a split the layer did not mark. It cannot be "
                    f"joined safely.")
        return torch.Size(local[0])
    if any(len(s) <= split or s[:split] + s[split + 1:] != local[0][:split] + local[0][split + 1:] for s in local):
        raise CheckpointMismatchError(f"{where}: {name!r}'s tensor-parallel slices have shapes {local}, which are not "
                                      f"slices along dimension {split} of one tensor.")
    shape = list(local[0])
    shape[split] = sum(s[split] for s in local)
    return torch.Size(shape)


def buffers_and_frozen(ckpt) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(persistent buffers, frozen parameters) of `ckpt` (a whole_model), whole."""
    if isinstance(ckpt, ModelParallelCheckpoint):
        return ckpt.buffers_and_frozen()
    module = module_tensors(ckpt)
    return buffer_weights(ckpt, module=module), frozen_weights(ckpt, module=module)
