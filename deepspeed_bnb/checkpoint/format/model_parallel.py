"""Where a rank sits in the model-parallel layout (tensor-parallel rank, pipeline stage), and how each of its
parameters is split across the tensor-parallel ranks: recorded in every optimizer record, read to join the ranks.

A checkpoint of a tensor- or pipeline-parallel run holds one set of rank files per model-parallel rank
(`*_mp_rank_XX_*`): under AutoTP the same parameter names on every tensor-parallel rank, each a slice of the logical
tensor along one dimension or the whole of it; under a pipeline each stage's own layers. Joining them (an 8-bit
universal checkpoint written from a model-parallel one) needs each parameter's split dimension, which neither the
files' shapes nor the names tell; DeepSpeed describes it only from 0.19.x on and only for AutoTP's own layers. So
every rank records it when it saves, and a reader refuses a checkpoint that lacks it, naming what is missing.

A pipeline's layer files (`layer_<i>-model_states.pt`) hold each layer's own state_dict and name the layer by its
index only; a TiedLayerSpec's module is `tied_modules.<key>` in the engine, which no file says. So a pipeline rank
also records the module's name of every layer file the save writes (`layers`), beside the place in the record.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, Union

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError

# parameter name -> the dimension its tensor-parallel slices are cut along (int), None where every tensor-parallel
# rank holds it whole, or a str saying why it cannot be joined (a layout deepspeed_bnb does not reshard)
Split = Union[int, None, str]


@dataclass(frozen=True)
class ModelParallelPlace:
    """One rank's place in the model-parallel layout, the same on all its data-parallel peers."""

    tp_size: int = 1  # tensor-parallel ranks (AutoTP's autotp_size); 1 without tensor parallelism
    tp_rank: int = 0  # this rank's tensor-parallel rank
    pp_size: int = 1  # pipeline stages; 1 without a pipeline
    pp_stage: int = 0  # this rank's stage
    splits: Dict[str, Split] = field(default_factory=dict)  # per parameter (tensor parallelism only): see Split
    # pipelines only (one stage too): the index of each layer file the save writes -> that layer's module name in the
    # engine (its index, or `tied_modules.<key>` for a TiedLayerSpec's module); every stage records every stage's
    # layers. Empty where not a pipeline or not recorded (then a reader infers the names: weights.pipeline_layers).
    # Not in to_dict(): the record holds it under its own key (constants.PIPELINE_LAYERS_KEY), which readers that
    # predate it ignore, where they would refuse an unknown key in the place.
    layers: Dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tp_size": self.tp_size, "tp_rank": self.tp_rank, "pp_size": self.pp_size,
                "pp_stage": self.pp_stage, "splits": dict(self.splits)}

    @property
    def size(self) -> int:
        """Model-parallel ranks: one set of rank files each."""
        return self.tp_size * self.pp_size


ALONE = ModelParallelPlace()  # a data-parallel-only run
TIED = "tied_modules."  # PipelineModule's prefix of the modules TiedLayerSpec shares between layers
_TIED_NAME = re.compile(r"^tied_modules\.[^.\s]+$")  # a ModuleDict key holds no "." (torch's add_module refuses one)


def layers_to_dict(layers: Dict[int, str]) -> Dict[str, str]:
    return {str(index): name for index, name in sorted(layers.items())}


def layers_from_dict(data, where: str) -> Dict[int, str]:
    """A pipeline's recorded layer names (ModelParallelPlace.layers), each checked: a layer file's index names its
    own layer (`<index>`) or a tied module (the file is not trusted to be well formed)."""
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and k.isdigit() and len(k) < 8 and isinstance(v, str) and
            (v == str(int(k)) or _TIED_NAME.match(v)) for k, v in data.items()):
        raise CheckpointMismatchError(f"{where}: the pipeline's layer names are not a map of layer indices to the "
                                      f"layer's own index or a 'tied_modules.<key>' name; the record is malformed "
                                      f"(damaged or crafted).")
    return {int(k): v for k, v in data.items()}


def place_from_dict(data, where: str) -> ModelParallelPlace:
    """A ModelParallelPlace read from a record: every count and split checked (the file is not trusted to be well
    formed)."""
    def malformed(what):
        return CheckpointMismatchError(f"{where}: the model-parallel place {what}; the record is malformed (damaged "
                                       f"or crafted).")

    if not isinstance(data, dict) or set(data) != {"tp_size", "tp_rank", "pp_size", "pp_stage", "splits"}:
        raise malformed("is not a dict of tp_size, tp_rank, pp_size, pp_stage and splits")
    counts = [data[k] for k in ("tp_size", "tp_rank", "pp_size", "pp_stage")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 20 for n in counts):
        raise malformed("has counts that are not integers in [0, 2^20)")
    if counts[0] < 1 or counts[2] < 1 or counts[1] >= counts[0] or counts[3] >= counts[2]:
        raise malformed(f"places rank {counts[1]} of {counts[0]} tensor-parallel ranks, stage {counts[3]} of "
                        f"{counts[2]}")
    splits = data["splits"]
    if not isinstance(splits, dict) or not all(
            isinstance(name, str) and (value is None or isinstance(value, str) or
                                       (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 8))
            for name, value in splits.items()):
        raise malformed("has splits that are not a map of names to a dimension (0-7), None or a reason")
    return ModelParallelPlace(*counts, dict(splits))


def no_place_error(where: str) -> CheckpointMismatchError:
    """The refusal for a record without a model-parallel place, where the ranks must be joined."""
    return CheckpointMismatchError(
        f"{where} has no model-parallel place (written by a deepspeed_bnb release before it was recorded): the "
        f"dimension each tensor-parallel parameter is split along is unknown, so the model-parallel ranks cannot be "
        f"joined. Resume it at its own tensor-parallel and pipeline sizes and save it again with this release.")


def split_of(place: ModelParallelPlace, name: str, where: str) -> Split:
    """The recorded split of parameter `name`; an error where the record names no split for it."""
    if place.tp_size == 1:
        return None
    if name not in place.splits:
        raise CheckpointMismatchError(f"{where}: the model-parallel place records no split for parameter {name!r}; "
                                      f"its tensor-parallel ranks cannot be joined. The record is of another model.")
    return place.splits[name]
