"""Data-parallel changes under pipeline and tensor parallelism: a checkpoint of 2 pipeline stages (ZeRO-1) or of 2
AutoTP ranks (ZeRO-2) saved at data-parallel size D loads at D' with the same model-parallel layout, D, D' in {1, 2}.

The runs are tests/support/parallel_scenarios.py's, in the launches shared with test_distributed.py
(tests/support/scenario_runs.py: 2 ranks save at DP 1 and load it, 4 ranks save at DP 2 and load both, 2 ranks again
load DP 2). Checks, as the DP-only matrix (test_elastic.py): every (model-parallel rank, parameter)'s codes, absmax,
fp32 moments, step and master weights byte-identical to what was saved, the module's weights the master weights, the
saved lr restored (the loader was built with a 50x larger one), 10 more steps tracking the run that never stopped,
bit-exact at the same size and stage. Control: loading without optimizer state diverges.

A change of the model-parallel size goes through the 8-bit universal checkpoint: each run's checkpoint exported
(its ranks joined per parameter) and loaded at model-parallel size 1, at data-parallel size 1 and 2; the whole
model's cut again for a model-parallel engine; and a 3D run (tensor-parallel 2 x 2 stages) loaded at four layouts.
"""

import os
import re
import shutil

import pytest
import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from support.parallel_scenarios import LOADER_STAGES, MODEL_PARALLEL, PARALLEL_KINDS, WHOLE, folder_of
from support.parallel3d_scenarios import KIND as KIND_3D, LOADS as LOADS_3D, SAVED_WORLD as SAVED_WORLD_3D
from support.scenario_runs import PARALLEL, SIZES

pytestmark = pytest.mark.multi_rank
FP32_TOL = 1e-5
WORLDS = [w for w in PARALLEL if w in SIZES]
CASES = [(kind, saved // MODEL_PARALLEL, loaded) for kind in PARALLEL_KINDS for saved in WORLDS for loaded in WORLDS]


def loads_of(scenario_results, scenario, cases):
    """(kind, saved data-parallel size, loading world size) -> result of every load by `scenario`: one per case."""
    loads = {}
    for world, result in scenario_results.items():
        for key, value in result.get(scenario, {}).items():
            kind, saved = key.rsplit("_from", 1)
            loads[(kind, int(saved) if saved.isdigit() else saved, world)] = value
    assert set(loads) == set(cases), sorted(map(str, loads))
    return loads


@pytest.fixture(scope="module")
def runs(scenario_results):
    saves = {world: result["parallel_save"] for world, result in scenario_results.items() if "parallel_save" in result}
    assert sorted(saves) == WORLDS
    return saves, loads_of(scenario_results, "parallel_load", CASES)


@pytest.mark.parametrize("kind,saved_dp,world", CASES)
def test_load_at_another_data_parallel_size(runs, kind, saved_dp, world):
    saves, loads = runs
    run, reference = loads[(kind, saved_dp, world)], saves[saved_dp * MODEL_PARALLEL][kind]["continued"]
    stage = LOADER_STAGES.get(kind, {}).get(world // MODEL_PARALLEL, PARALLEL_KINDS[kind]["stage"])
    assert run["stage"] == stage
    assert run["state_identical"], "per-parameter state or master weights differ from what was saved"
    assert run["weights_follow_master"], "the module's weights are not the loaded master weights"
    assert run["lr"] == [1e-3], "hyper-parameters must come from the checkpoint"
    assert max(abs(a - b) for a, b in zip(run["continued"], reference)) < FP32_TOL, \
        {"continued": run["continued"], "reference": reference}
    assert max(abs(a - b) for a, b in zip(run["state_dropped"], reference)) > 100 * FP32_TOL  # control
    if saved_dp == world // MODEL_PARALLEL and stage == PARALLEL_KINDS[kind]["stage"]:
        assert run["continued"] == reference


# ---- a change of the model-parallel layout: through the 8-bit universal checkpoint ----------------------------------

UNIVERSAL_CASES = [(kind, world // MODEL_PARALLEL, loaded) for kind in PARALLEL_KINDS for world in WORLDS
                   for loaded in (1, 2) if loaded in SIZES and (loaded, world) in ((1, 2), (1, 4), (2, 4))]
# a requantized block moves its moments by up to half a quantization step, which changes the updates: with 8-bit
# state cut inside blocks (AutoTP's row-parallel weights, its uneven vocabulary split) the continued losses differ by
# ~2.5e-4 over 10 steps (the same run with 32-bit state continues bit for bit); a fresh-moment resume differs by ~1
REQUANTIZED_TOL = 1e-3


@pytest.fixture(scope="module")
def universal_runs(scenario_results):
    saves = {world: result["parallel_save"] for world, result in scenario_results.items() if "parallel_save" in result}
    return saves, loads_of(scenario_results, "parallel_universal", UNIVERSAL_CASES)


@pytest.mark.parametrize("kind,saved_dp,world", UNIVERSAL_CASES)
def test_a_model_parallel_checkpoint_resumes_at_model_parallel_size_1(universal_runs, kind, saved_dp, world):
    """Tensor-parallel 2 (or 2 pipeline stages) x DP saved_dp -> model-parallel 1 x DP world, through `deepspeed-bnb
    export --universal` and load_universal. Checked against DeepSpeed's own record of each rank's slice shapes and
    the live engines' state at the save: master weights the slices joined exactly; 8-bit codes and absmax moved bit
    for bit wherever every slice is whole quantization blocks (a pipeline stage's parameters, AutoTP's column cuts
    of 256-multiples); elsewhere requantized within half a quantization step of the joined slices' fp32 values (and
    the report counts them); the continued losses track the run that never stopped; a fresh-moment resume does not."""
    saves, loads = universal_runs
    run, reference = loads[(kind, saved_dp, world)], saves[saved_dp * MODEL_PARALLEL][kind]["continued"]
    assert not run["master_differs"], run["master_differs"]
    assert not run["codes_differ"], run["codes_differ"]
    assert run["moved"], "no parameter's 8-bit state moved unchanged"  # control: the check compared something
    assert run["weights_follow_master"] and run["lr"] == [1e-3]
    assert run["largest_steps"] <= 0.5 + 1e-4, run["largest_steps"]
    drift = max(abs(a - b) for a, b in zip(run["continued"], reference))
    control = max(abs(a - b) for a, b in zip(run["state_dropped"], reference))
    if PARALLEL_KINDS[kind]["pipeline"]:  # stages hold whole parameters: nothing requantized
        assert not run["requantized"] and "no block requantized" in run["report"]
        assert drift < FP32_TOL, {"continued": run["continued"], "reference": reference}
        if saved_dp == world:  # the same data-parallel size sums the gradients in the same order: the same bits
            assert run["continued"] == reference
    else:
        assert run["requantized"] and "blocks of state1, state2 requantized" in run["report"], run["report"]
        assert drift < REQUANTIZED_TOL, {"continued": run["continued"], "reference": reference}
    assert control > 100 * REQUANTIZED_TOL, control


def deepspeeds_split(info, name):
    """The split DeepSpeed's own AutoTP conversion schema (0.19.x model states) gives parameter `name`, as
    ds_to_universal reads it: row-parallel patterns along dim 1, replicated ones whole, the rest along dim 0."""
    def matches(patterns):
        return any(re.match(pattern, name) for pattern in patterns)
    if matches(info.get("tp_replicated_parameter_patterns", [])):
        return None
    return 1 if matches(info.get("parameter_with_row_parallelism_patterns", [])) else 0


@pytest.mark.skipif("tp2_stage2" not in PARALLEL_KINDS, reason="no AutoTP on CPU ranks before DeepSpeed 0.18.0")
def test_the_recorded_tensor_parallel_splits_are_deepspeeds(scenario_results, scenario_folder):
    """Each rank's record names, for every parameter, the dimension AutoTP split it along: the same as DeepSpeed's own
    conversion schema where the release writes one (0.19.x), and the tensor-parallel rank of the files."""
    folder = folder_of(scenario_folder, "tp2_stage2", 1)
    for mp in range(MODEL_PARALLEL):
        place = SavedCheckpoint(folder, mp_rank=mp).record(0)[C.MODEL_PARALLEL_KEY]
        assert (place["tp_size"], place["tp_rank"], place["pp_size"]) == (MODEL_PARALLEL, mp, 1)
        states = torch.load(os.path.join(folder, "t", f"mp_rank_{mp:02d}_model_states.pt"), weights_only=False)
        info = states.get("universal_checkpoint_info")
        if info is None:
            continue
        names = [name for group in states["param_shapes"] for name in group] + list(states["frozen_param_shapes"])
        theirs = {name: deepspeeds_split(info, name) for name in names}  # the frozen parameters' too
        assert place["splits"] == theirs
        assert set(place["splits"].values()) == {None, 0, 1}  # control: all three kinds occur in the model


@pytest.mark.parametrize("kind", PARALLEL_KINDS)
def test_offline_tools_refuse_one_model_parallel_ranks_share(scenario_results, scenario_folder, tmp_path, kind):
    """reshape, convert and export (weights) read one model-parallel rank's files: each refuses a tag several ranks
    wrote, naming the count and the route that joins them, instead of writing that rank's part as the model."""
    from deepspeed_bnb.checkpoint.tools.convert import convert
    from deepspeed_bnb.checkpoint.tools.export import export
    from deepspeed_bnb.checkpoint.tools.reshape import reshape
    folder = folder_of(scenario_folder, kind, 1)
    runs = {"reshape": lambda out: reshape(folder, out, 2, progress=False),
            "convert": lambda out: convert(folder, out, "32bit", progress=False),
            "export": lambda out: export(folder, out, progress=False)}
    for what, run in runs.items():
        with pytest.raises(CheckpointMismatchError, match=r"written by 2 model-parallel ranks.*export --universal"):
            run(str(tmp_path / what))
        assert not os.path.exists(tmp_path / what)
    from deepspeed_bnb.checkpoint.tools.summary import summary  # inspect reads rank 0, and says so
    assert "2 model-parallel ranks" in summary(folder) and "rank 0's parameters only" in summary(folder)


# (kind, saved DP or WHOLE: the run of model-parallel size 1, loading world)
SPLIT_CASES = [(kind, saved, 2) for kind in PARALLEL_KINDS for saved in (2, WHOLE)] if 4 in SIZES else []


@pytest.fixture(scope="module")
def split_runs(scenario_results):
    return loads_of(scenario_results, "parallel_universal_split", SPLIT_CASES)


@pytest.mark.parametrize("kind,saved_dp,world", SPLIT_CASES)
def test_a_whole_model_universal_checkpoint_loads_into_a_model_parallel_engine(scenario_results, split_runs, kind,
                                                                            saved_dp, world):
    """The other direction: a universal checkpoint of the whole model loaded by an engine that is itself
    tensor-parallel 2 (or 2 stages) at DP 1, the checkpoint cut per model-parallel rank at load; the checkpoint joined
    from tensor-parallel 2 (or 2 stages) at DP 2, or written by the same model trained at model-parallel size 1
    (WHOLE: 1 -> 2). Every (rank, parameter)'s master weights are its slice of what was saved; its 8-bit codes and
    absmax too where its slice is whole blocks along dim 0 (or it is a stage's whole parameter); elsewhere the saved
    values of the slice requantized within half a step. The continued losses track the run that never stopped; a
    fresh-moment resume does not."""
    run = split_runs[(kind, saved_dp, world)]
    reference = (scenario_results[1]["parallel_whole_save"] if saved_dp == WHOLE else
                 scenario_results[saved_dp * MODEL_PARALLEL]["parallel_save"])[kind]["continued"]
    assert not run["master_differs"] and not run["codes_differ"], (run["master_differs"], run["codes_differ"])
    assert run["moved"] and run["weights_follow_master"] and run["lr"] == [1e-3]
    assert run["largest_steps"] <= 0.5 + 1e-4, run["largest_steps"]
    drift = max(abs(a - b) for a, b in zip(run["continued"], reference))
    control = max(abs(a - b) for a, b in zip(run["state_dropped"], reference))
    if PARALLEL_KINDS[kind]["pipeline"]:
        assert not run["requantized"] and drift < FP32_TOL, {"continued": run["continued"], "reference": reference}
    else:
        assert run["requantized"] and drift < REQUANTIZED_TOL, {"continued": run["continued"], "reference": reference}
    assert control > 100 * REQUANTIZED_TOL, control


@pytest.mark.parametrize("kind", PARALLEL_KINDS)
def test_deepspeeds_converter_joins_the_model_parallel_ranks_as_export_does(scenario_results, scenario_folder,
                                                                          tmp_path, kind):
    """DeepSpeed's ds_to_universal.main, called in-process on a tensor-parallel (or pipeline) checkpoint of ours,
    writes the same joined 8-bit universal checkpoint as `export --universal` (which the loads above used): the same
    parameters, master weights and state, bit for bit."""
    from types import SimpleNamespace

    from deepspeed.checkpoint.ds_to_universal import main
    from support.parallel_scenarios import universal_of, universal_states
    folder = folder_of(scenario_folder, kind, 1)
    target = str(tmp_path / "t_universal")
    shutil.copytree(os.path.join(folder, "t"), str(tmp_path / "t"))
    main(SimpleNamespace(input_folder=str(tmp_path / "t"), output_folder=target, num_extract_workers=1,
                         num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))
    theirs, ours = universal_states(target), universal_states(universal_of(scenario_folder, kind, 1))
    assert theirs.keys() == ours.keys() and len(ours) > 4
    for name in ours:
        assert all(torch.equal(theirs[name][k], ours[name][k]) if torch.is_tensor(ours[name][k])
                   else theirs[name][k] == ours[name][k] for k in ours[name]), name


# ---- tensor and pipeline parallelism together (tests/support/parallel3d_scenarios.py) -------------------------------

THREE_D_CASES = [(world, tp, pp) for world, layouts in LOADS_3D.items() for tp, pp in layouts
                 if world in SIZES] if SAVED_WORLD_3D in SIZES else []


@pytest.mark.parametrize("world,tp,pp", THREE_D_CASES)
def test_a_3d_checkpoint_resumes_with_tensor_pipeline_and_data_parallel_sizes_changed(scenario_results, world, tp, pp):
    """Tensor-parallel 2 x 2 pipeline stages x DP 1 (Megatron-style layers in a PipelineModule, ZeRO-1) -> the whole
    model at DP 1 and 2, tensor-parallel 2 without stages, 2 stages without tensor parallelism, through one 8-bit
    universal checkpoint (the four model-parallel ranks joined). At model-parallel size 1 every parameter's master
    weights are the saved ranks' slices joined exactly (located by DeepSpeed's own param_shapes) and its 8-bit state
    moved bit for bit where every slice is whole blocks (each stage's replicated layers, the first block's column
    cuts); at the other layouts each rank's slice of the universal checkpoint; elsewhere within half a quantization
    step. The continued losses track the run that never stopped; a fresh-moment resume does not."""
    run = scenario_results[world]["parallel3d_load"][f"tp{tp}pp{pp}dp{world // (tp * pp)}"]
    reference = scenario_results[SAVED_WORLD_3D]["parallel3d_save"][KIND_3D]["continued"]
    assert not run["master_differs"] and not run["codes_differ"], (run["master_differs"], run["codes_differ"])
    assert run["moved"], "no parameter's state moved unchanged"  # control: the comparison compared something
    assert run["weights_follow_master"] and run["lr"] == [1e-3]
    assert run["largest_steps"] <= 0.5 + 1e-4, run["largest_steps"]
    assert "2 tensor-parallel x 2 pipeline ranks" in run["report"] and "requantized" in run["report"], run["report"]
    if tp == 1 and pp == 1:  # row-parallel cuts (along dim 1) are joined by requantizing: the report counted them
        assert run["requantized"] and any("out_weight" in name for name in run["requantized"]), run["requantized"]
    if tp == 1 and pp > 1:  # stages cut nothing: every 8-bit state as the universal checkpoint holds it; the second
        # block's weights are quantized at load from the fp32 state their 760-element slices held (under min_8bit_size)
        assert {key.split("/", 1)[1] for key in run["requantized"]} == {"2.fc_weight", "2.out_weight"}, \
            run["requantized"]
    drift = max(abs(a - b) for a, b in zip(run["continued"], reference))
    control = max(abs(a - b) for a, b in zip(run["state_dropped"], reference))
    assert drift < REQUANTIZED_TOL, {"continued": run["continued"], "reference": reference}
    assert control > 100 * REQUANTIZED_TOL, control


@pytest.mark.skipif(SAVED_WORLD_3D not in SIZES, reason="the 3D run takes 4 ranks")
def test_a_3d_run_records_each_ranks_place_and_megatrons_splits(scenario_results, scenario_folder):
    """Each of the 4 model-parallel ranks records its tensor-parallel rank and stage (DeepSpeed's file number is
    stage x 2 + tensor-parallel rank) and, from Megatron's marks, the split of every parameter of its stage."""
    folder = folder_of(scenario_folder, KIND_3D, 1)
    for mp in range(SAVED_WORLD_3D):
        place = SavedCheckpoint(folder, mp_rank=mp).record(0)[C.MODEL_PARALLEL_KEY]
        assert (place["tp_size"], place["tp_rank"], place["pp_size"], place["pp_stage"]) == (2, mp % 2, 2, mp // 2)
        cut = {"fc_weight": 0, "fc_bias": 0, "out_weight": 1}  # out_bias, the embedding and the head: whole
        assert place["splits"] == {name: cut.get(name.split(".", 1)[1]) for name in place["splits"]}, place["splits"]
        assert {name.split(".", 1)[1] for name in place["splits"]} >= {*cut, "out_bias"}  # control: its MLP is there
