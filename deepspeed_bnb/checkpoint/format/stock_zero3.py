"""A stock DeepSpeed ZeRO-3 checkpoint read per parameter: fp32 weights and the torch optimizer's moments.

What stock ZeRO-3 (DeepSpeed 0.16-0.19) writes per rank, and how it is cut here (as zero_to_fp32 cuts the weights):
- `fp32_flat_groups`: one flat fp32 tensor per sub-group, the rank's slice of ceil(numel / dp) elements of every
  parameter of the sub-group in turn; the model states list the sub-groups' parameters (`param_shapes`, one dict per
  sub-group). Joined over ranks, the slices give each parameter (its padding past numel dropped).
- the torch optimizer's own state_dict (`optimizer_state_dict` inside the ZeRO state): each param group's `params`
  are the indices of its sub-groups' flat tensors, and each index's state (Adam: exp_avg, exp_avg_sq, step; a
  bitsandbytes optimizer: its state of the flat tensor, dequantized by stock_moments.py) is shaped like that flat
  tensor, so the moments are cut the same way.
"""

import math
from typing import Callable, Dict, List, Tuple

import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.sources import OPTIMIZER_STATE_DICT
from deepspeed_bnb.checkpoint.format.stock_moments import flat_moments
from deepspeed_bnb.optim.state_names import ADAM_ROWS, KeyRows, row_names


def cut_flat_groups(ckpt, flats_of: Callable[[int], List[torch.Tensor]], what: str) -> Dict[str, torch.Tensor]:
    """name -> values (flattened, the parameter's numel) of every parameter of `ckpt`'s sub-groups, from
    `flats_of(rank)`: that rank's flat tensor of each sub-group, in order. `what` names the entry in errors."""
    shapes = [(name, torch.Size(shape)) for group in ckpt.param_shapes() for name, shape in group.items()]
    slices = [math.ceil(shape.numel() / ckpt.dp) for _, shape in shapes]
    flats = []
    for rank in range(ckpt.dp):
        groups = flats_of(rank)
        if not isinstance(groups, list) or not all(torch.is_tensor(t) for t in groups) or \
                sum(t.numel() for t in groups) < sum(slices):
            raise CheckpointMismatchError(f"{ckpt.source.name(rank)}: {what} does not hold the {sum(slices):,} "
                                          f"elements its model states' parameters take on each rank; the files are "
                                          f"malformed or of different runs.")
        flats.append(torch.cat([t.reshape(-1) for t in groups]))
    values, offset = {}, 0
    for (name, shape), size in zip(shapes, slices):
        joined = torch.cat([flat.narrow(0, offset, size) for flat in flats])
        values[name] = joined.narrow(0, 0, shape.numel()).clone()
        offset += size
    return values


def fp32_weights(ckpt) -> Dict[str, torch.Tensor]:
    """name -> fp32 weights (the parameter's shape) of every trained parameter of a stock ZeRO-3 checkpoint."""
    shapes = {name: shape for group in ckpt.param_shapes() for name, shape in group.items()}
    cut = cut_flat_groups(ckpt, lambda rank: ckpt.optimizer_state(rank).get(C.FP32_FLAT_GROUPS_KEY),
                          f"'{C.FP32_FLAT_GROUPS_KEY}'")
    return {name: values.reshape(shapes[name]).float() for name, values in cut.items()}


def _torch_state(ckpt, rank: int) -> dict:
    """The torch optimizer's state_dict in a stock ZeRO-3 rank file, checked for the entries read here."""
    state = ckpt.optimizer_state(rank).get(OPTIMIZER_STATE_DICT)
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or \
            not isinstance(state.get("param_groups"), list) or \
            not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in state["param_groups"]):
        raise CheckpointMismatchError(f"{ckpt.source.name(rank)}: the ZeRO-3 state holds no torch optimizer "
                                      f"state_dict ('{OPTIMIZER_STATE_DICT}' with 'state' and 'param_groups'); the "
                                      f"file is malformed.")
    return state


class StockZero3:
    """A stock ZeRO-3 checkpoint of a torch Adam-family optimizer, per param group as `convert` reads stock ZeRO-1/2
    ones: each param group's sub-groups joined. Everything else (files, model states, DP size) is the wrapped
    SavedCheckpoint's, so the offline writers take it as they take that."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        torch_state = _torch_state(ckpt, 0)
        sub_groups = len(ckpt.param_shapes())
        indices = [g["params"] for g in torch_state["param_groups"]]
        if [i for group in indices for i in group] != list(range(sub_groups)):
            raise CheckpointMismatchError(
                f"{ckpt.source.name(0)}: the torch optimizer's param groups hold parameters {indices}, where stock "
                f"ZeRO-3 gives each of its {sub_groups} sub-groups (the model states' 'param_shapes') one flat tensor, "
                f"in order; the files are malformed or not a stock ZeRO-3 checkpoint.")
        self.sub_groups = indices  # per param group: the indices of its sub-groups
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in torch_state["param_groups"]]
        self._weights = None
        self._moments = None

    def __getattr__(self, name):  # what is not per param group: the wrapped checkpoint's
        return getattr(self.__dict__["ckpt"], name)

    def param_shapes(self) -> List[Dict[str, torch.Size]]:
        sub = self.ckpt.param_shapes()
        return [{name: shape for i in indices for name, shape in sub[i].items()} for indices in self.sub_groups]

    def master_weights(self, g: int) -> List[torch.Tensor]:
        if self._weights is None:
            self._weights = fp32_weights(self.ckpt)
        return [self._weights[name].reshape(-1) for name in self.param_shapes()[g]]

    def hyperparams(self, g: int) -> dict:
        return dict(self.hyper[g])

    def moments(self, g: int, rows: KeyRows = ADAM_ROWS) -> List[Tuple[List[torch.Tensor], int]]:
        """(the moments of `rows`, e.g. [exp_avg, exp_avg_sq], step) of each parameter of param group g, flattened, in
        fp32."""
        if self._moments is None or self._moments[0] != rows:
            self._moments = (rows, *self._read_moments(rows))
        _, values, steps = self._moments
        return [([values[key][name].float() for key in row_names(rows)], steps[g]) for name in self.param_shapes()[g]]

    def _read_moments(self, rows: KeyRows):
        sub = self.ckpt.param_shapes()
        states = [_torch_state(self.ckpt, rank)["state"] for rank in range(self.ckpt.dp)]

        moments = [{i: flat_moments(states[rank].get(i), f"{self.ckpt.source.name(rank)} (sub-group {i})", rows)
                    for i in range(len(sub))} for rank in range(self.ckpt.dp)]  # torch's, or bnb's dequantized
        values = {key: cut_flat_groups(self.ckpt, lambda rank: [moments[rank][i][key] for i in range(len(sub))],
                                       f"the optimizer's '{key}'") for key in row_names(rows)}
        steps = []
        for indices in self.sub_groups:
            found = {float(states[0][i].get("step", 0)) for i in indices}
            if len(found) > 1:
                raise CheckpointMismatchError(f"{self.ckpt.source.name(0)}: the sub-groups {indices} of one param "
                                              f"group are at different steps {sorted(found)}; the file is malformed.")
            steps.append(int(found.pop()) if found else 0)
        return values, steps
