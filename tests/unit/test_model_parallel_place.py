"""The model-parallel place each rank records (checkpoint/format/model_parallel.py, runtime/model_parallel.py): read
back only when well formed, and each parameter's tensor-parallel split taken from what marks it.

The AutoTP layers themselves are checked against DeepSpeed's own conversion schema in
tests/distributed/test_model_parallel.py (AutoTP needs a tensor-parallel group); here the Megatron-style marks, AutoTP's
layers as releases without its conversion metadata leave them, the parameters nothing marks, tied weights, and the
refusals of damaged records.
"""

import pytest
import torch
from torch import nn

from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.model_parallel import ALONE, ModelParallelPlace, no_place_error, \
    place_from_dict, split_of
from deepspeed_bnb.checkpoint.format.records import build_record, saved_place
from deepspeed_bnb.runtime.model_parallel import tensor_parallel_splits

PLACE = ModelParallelPlace(2, 1, 3, 2, {"a.weight": 0, "b.weight": 1, "norm.weight": None, "fused.weight": "why"})


def test_a_place_reads_back_as_written():
    assert place_from_dict(PLACE.to_dict(), "f") == PLACE
    assert place_from_dict(ALONE.to_dict(), "f") == ALONE and ALONE.size == 1 and PLACE.size == 6


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("splits"), lambda d: d.update(tp_rank=2), lambda d: d.update(pp_size=0),
    lambda d: d.update(tp_size=True), lambda d: d.update(splits={"a.weight": 9}),
    lambda d: d.update(splits={"a.weight": 1.5}), lambda d: d.update(extra=1), lambda d: d.update(pp_stage=-1)])
def test_a_damaged_place_is_refused_naming_the_file(damage):
    data = PLACE.to_dict()
    damage(data)
    with pytest.raises(CheckpointMismatchError, match=r"rank_7\.pt: the model-parallel place .* malformed"):
        place_from_dict(data, "rank_7.pt")


def test_a_pipelines_layer_names_read_back_beside_the_place():
    layers = {0: "tied_modules.embed", 1: "1", 2: "tied_modules.embed"}
    piped = ModelParallelPlace(1, 0, 2, 1, {}, layers)
    record = build_record("bnb.optim.AdamW8bit", "adam", 0, [], model_parallel=piped)
    assert record["model_parallel"] == place_from_dict(record["model_parallel"], "f").to_dict()  # the place as before
    assert saved_place(record, "f") == piped and saved_place(record, "f").layers == layers
    plain = build_record("bnb.optim.AdamW8bit", "adam", 0, [], model_parallel=PLACE)
    assert "pipeline_layers" not in plain and saved_place(plain, "f") == PLACE


@pytest.mark.parametrize("layers", [
    {"x": "1"}, {"1": "2"}, {"1": "tied_modules.a.b"}, {"1": "tied_modules."}, {"1": 1}, ["1"], {"-1": "-1"},
    {"1": "tied_modules.a b"}])
def test_damaged_layer_names_are_refused_naming_the_file(layers):
    record = build_record("bnb.optim.AdamW8bit", "adam", 0, [], model_parallel=PLACE)
    record["pipeline_layers"] = layers
    with pytest.raises(CheckpointMismatchError, match=r"rank_7\.pt: the pipeline's layer names .* malformed"):
        saved_place(record, "rank_7.pt")


def test_split_of_names_what_is_missing():
    assert split_of(PLACE, "b.weight", "f") == 1 and split_of(PLACE, "norm.weight", "f") is None
    assert split_of(ALONE, "anything", "f") is None  # no tensor parallelism: every parameter whole
    with pytest.raises(CheckpointMismatchError, match="records no split for parameter 'c.weight'"):
        split_of(PLACE, "c.weight", "f")
    assert "no model-parallel place" in str(no_place_error("rank_0.pt"))


class Marked(nn.Module):
    """Megatron-LM's marks on its tensor-parallel parameters, a plain norm, and an embedding tied to the head."""

    def __init__(self):
        super().__init__()
        self.column = nn.Linear(4, 4)
        self.row = nn.Linear(4, 4)
        self.strided = nn.Linear(4, 4, bias=False)
        self.norm = nn.LayerNorm(4)
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        for param, dim, stride in ((self.column.weight, 0, 1), (self.column.bias, 0, 1), (self.row.weight, 1, 1),
                                   (self.strided.weight, 0, 3)):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride


def test_splits_follow_the_marks_and_name_each_parameter_once():
    splits = tensor_parallel_splits(Marked())
    assert splits == {"column.weight": 0, "column.bias": 0, "row.weight": 1, "row.bias": None,
                      "strided.weight": splits["strided.weight"], "norm.weight": None, "norm.bias": None,
                      "embed.weight": None}  # the tied head is the embedding's (the engine's name for it)
    assert "strided" in splits["strided.weight"] and "partition_stride 3" in splits["strided.weight"]
    assert list(splits) == [name for name, _ in Marked().named_parameters()]  # control: the engine's names, in order
    assert tensor_parallel_splits(nn.Linear(2, 2)) == {"weight": None, "bias": None}


def autotp_layer(kind: str) -> nn.Module:
    """One of AutoTP's plain layers (`LinearLayer`, `LinearAllreduce`) as DeepSpeed before 0.19 leaves it: its weight
    and bias marked `tensor_model_parallel` (AutoTP's config_tp_params), no partition_dim and no conversion metadata.
    Built without __init__, which needs a tensor-parallel group."""
    from deepspeed.module_inject import layers
    layer = getattr(layers, kind).__new__(getattr(layers, kind))
    nn.Module.__init__(layer)
    layer.weight, layer.bias = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    for param in (layer.weight, layer.bias):
        param.tensor_model_parallel = True
    return layer


def test_autotp_layers_without_metadata_split_by_their_type():
    model = nn.Module()
    model.column, model.row = autotp_layer("LinearLayer"), autotp_layer("LinearAllreduce")
    model.marked = nn.Linear(4, 4, bias=False)
    model.marked.weight.tensor_model_parallel = True  # a Megatron-style mark without its partition_dim
    splits = tensor_parallel_splits(model)
    assert splits["column.weight"] == 0 and splits["column.bias"] == 0
    assert splits["row.weight"] == 1 and splits["row.bias"] is None
    assert "without a partition_dim" in splits["marked.weight"]  # not joined: nothing says how it is cut


class Grid016:
    """The methods a PipelineParallelGrid of DeepSpeed 0.16.x has for a rank on stage 1 of 2 at tensor-parallel rank
    1 of 2: its "model parallel" size counts stages x tensor-parallel ranks (4), and it has no
    get_tensor_model_parallel_* methods (0.17 added them as aliases of the slice-parallel ones)."""

    def get_model_parallel_world_size(self):
        return 4

    def get_model_parallel_rank(self):
        return 3

    def get_slice_parallel_world_size(self):
        return 2

    def get_slice_parallel_rank(self):
        return 1

    def get_pipe_parallel_world_size(self):
        return 2

    def get_stage_id(self):
        return 1


class Megatron:
    """A client's Megatron-style mpu: tensor-parallel methods, no pipeline."""

    def get_tensor_model_parallel_world_size(self):
        return 2

    def get_tensor_model_parallel_rank(self):
        return 1

    def get_model_parallel_world_size(self):
        return 99  # not what a reader may take for the tensor-parallel size

    def get_model_parallel_rank(self):
        return 98


@pytest.mark.parametrize("mpu,expected", [(Grid016(), (2, 1, 2, 1)), (Megatron(), (2, 1, 1, 0))])
def test_the_place_takes_the_tensor_parallel_part_of_a_grid(mpu, expected):
    """A pipeline grid's tensor-parallel size is its slice-parallel one, on releases without the tensor-parallel
    aliases too (there the model-parallel size, stages x slices, was once recorded as the tensor-parallel size, and
    the checkpoint's ranks could not be joined)."""
    from types import SimpleNamespace

    from deepspeed_bnb.runtime.model_parallel import place_of
    place = place_of(SimpleNamespace(mpu=mpu, module=Marked()))
    assert (place.tp_size, place.tp_rank, place.pp_size, place.pp_stage) == expected
    assert place.splits["row.weight"] == 1
