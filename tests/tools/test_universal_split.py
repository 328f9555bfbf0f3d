"""A whole-model universal checkpoint cut for the ranks of a tensor- or pipeline-parallel engine (checkpoint/tools/
universal_split.py), offline: what each model-parallel rank's files hold, and the layouts refused before anything is
written. The engines themselves load such cuts in tests/distributed/test_model_parallel.py.

Oracle: the universal checkpoint's own master weights and state (exported from a trained run's checkpoint), sliced
here with torch's narrow: each rank's master weights are exactly the slices; a parameter every rank holds whole keeps
its 8-bit state bit for bit; joining the ranks again (format/merged.py) gives back every master weight exactly.
"""

import os

import pytest
import torch

from deepspeed_bnb.checkpoint.format import constants as C
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
from deepspeed_bnb.checkpoint.format.merged import open_whole_model
from deepspeed_bnb.checkpoint.format.model_parallel import ModelParallelPlace
from deepspeed_bnb.checkpoint.format.reader import SavedCheckpoint
from deepspeed_bnb.checkpoint.tools.export import export
from deepspeed_bnb.checkpoint.tools.universal import UniversalCheckpoint
from deepspeed_bnb.checkpoint.tools.universal_split import convert_for_model_parallel, rank_layouts
from support.toy import MIN_8BIT_SIZE, build_engine, train_steps

import bitsandbytes as bnb

SPLITS = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}  # column cut of fc1, row cut of fc2 (uneven: 301)


@pytest.fixture(scope="module")
def universal(one_rank, tmp_path_factory):
    folder, out = str(tmp_path_factory.mktemp("saved")), str(tmp_path_factory.mktemp("universal") / "u")
    engine = build_engine(min_8bit_size=MIN_8BIT_SIZE, lr=1e-2)
    train_steps(engine, range(3))
    engine.save_checkpoint(folder, tag="t")
    export(folder, out, universal=True, progress=False)
    return out


def layouts_for(universal_dir, splits=SPLITS, widths=(151, 150), tp=2, **changes):
    """Each tensor-parallel rank's (place, local shapes, no frozen parameters, no buffers) for `splits`, the widths
    along the split dimension."""
    shapes = UniversalCheckpoint(universal_dir).param_shapes()
    held = []
    for rank in range(tp):
        names = {name: None for group in shapes for name in group}
        names.update(splits)
        names.update({name: None for name in changes.get("add", ())})
        place = ModelParallelPlace(tp, rank, 1, 0, names)
        local = []
        for group in shapes:
            local.append({})
            for name, shape in group.items():
                shape = list(shape)
                if name in splits and isinstance(splits[name], int):
                    shape[splits[name]] = widths[rank]
                local[-1][name] = tuple(shape)
        held.append((place, local, {}, ()))
    for rank, (place, local, _, _) in enumerate(held):
        for name, shape in changes.get("shapes", {}).get(rank, {}).items():
            local[0][name] = shape
        for name in changes.get("drop", ()):
            local[0].pop(name)
        for name in changes.get("add", ()):
            local[0][name] = (4,)
    return rank_layouts(held)


def widths_of(tp, total=301):
    """AutoTP's uneven cut of `total` over `tp` ranks: the first ranks one wider."""
    return tuple(total // tp + (rank < total % tp) for rank in range(tp))


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_each_rank_holds_the_slices_of_the_whole_model(universal, tmp_path, tp):
    """Tensor-parallel sizes 2, 3 and 4 (the engines in the distributed tests run 2: the suite launches at most 4
    ranks), each an uneven cut of 301."""
    out, widths = str(tmp_path / "cut"), widths_of(tp)
    report = convert_for_model_parallel(universal, out, layouts_for(universal, widths=widths, tp=tp),
                                        bnb.optim.AdamW8bit, MIN_8BIT_SIZE, stage=2)
    assert f"for {tp} model-parallel ranks" in report and "requantized" in report, report
    whole = UniversalCheckpoint(universal)
    shapes, masters = whole.param_shapes()[0], dict(zip(whole.param_shapes()[0], whole.master_weights(0)))
    states = dict(zip(shapes, whole.param_states(0)))
    for rank in range(tp):
        width_start = sum(widths[:rank])
        ckpt = SavedCheckpoint(out, mp_rank=rank)
        place = ckpt.record(0)[C.MODEL_PARALLEL_KEY]
        assert (place["tp_size"], place["tp_rank"]) == (tp, rank) and place["splits"]["fc2.weight"] == 1
        for (name, local), master, state in zip(ckpt.param_shapes()[0].items(), ckpt.master_weights(0),
                                                ckpt.param_states(0)):
            expected = masters[name].reshape(shapes[name])
            if name in SPLITS:
                expected = expected.narrow(SPLITS[name], width_start, local[SPLITS[name]])
            assert torch.equal(master, expected.reshape(-1)), name
            if name not in SPLITS:  # held whole: its state as saved, bit for bit
                assert all(torch.equal(state[k], states[name][k]) if torch.is_tensor(state[k]) else
                           state[k] == states[name][k] for k in state), name
    joined = open_whole_model(out)  # and back: every master weight exactly
    for name, master in zip(joined.param_shapes()[0], joined.master_weights(0)):
        assert torch.equal(master, masters[name]), name


def test_each_rank_keeps_its_engines_precision_per_parameter(universal, tmp_path):
    """A layout that names a parameter's precision (the loading engine's, from a bnb override such as HF Trainer's
    32-bit embeddings) gets it on that rank: the embedding, 8-bit by its size, is written with 32-bit state whose
    moments are the saved codes dequantized, on the rank that names it only (control: the other rank keeps 8 bits)."""
    import dataclasses
    out = str(tmp_path / "cut")
    layouts = layouts_for(universal)
    layouts[0] = dataclasses.replace(layouts[0], eight_bit={"emb.weight": False})
    convert_for_model_parallel(universal, out, layouts, bnb.optim.AdamW8bit, MIN_8BIT_SIZE, stage=2)
    whole = UniversalCheckpoint(universal)
    names = list(whole.param_shapes()[0])
    saved = whole.param_states(0)[names.index("emb.weight")]
    expected = whole.moments(0)[names.index("emb.weight")][0]
    assert saved.eight_bit
    for rank, eight_bit in ((0, False), (1, True)):
        ckpt = SavedCheckpoint(out, mp_rank=rank)
        state = ckpt.param_states(0)[list(ckpt.param_shapes()[0]).index("emb.weight")]
        assert state.eight_bit == eight_bit, rank
        if not eight_bit:
            assert torch.equal(state["state1"].reshape(-1), expected[0].reshape(-1).float())
            assert torch.equal(state["state2"].reshape(-1), expected[1].reshape(-1).float())


@pytest.mark.parametrize("changes,message", [
    ({"add": ["extra.weight"]}, r"parameter 'extra.weight' \(param group 0\) is not in the checkpoint"),
    ({"shapes": {1: {"fc1.weight": (200, 40)}}}, r"parameter 'fc1.weight' of shape \(301, 40\) cannot give this "
                                                 r"rank the slice"),
    ({"shapes": {0: {"emb.weight": (97, 20)}}}, r"parameter 'emb.weight' is \(97, 40\) in the checkpoint; this rank "
                                                r"holds it as \(97, 20\)"),
])
def test_a_layout_the_checkpoint_cannot_be_cut_into_is_refused_before_anything_is_written(universal, tmp_path,
                                                                                        changes, message):
    out = str(tmp_path / "cut")
    with pytest.raises(CheckpointMismatchError, match=message):
        convert_for_model_parallel(universal, out, layouts_for(universal, **changes), bnb.optim.AdamW8bit,
                                   MIN_8BIT_SIZE, stage=2)
    assert not os.path.exists(out)


def test_a_split_recorded_as_not_joinable_is_refused_by_name(universal, tmp_path):
    layouts = layouts_for(universal, splits={**SPLITS, "head.weight": "a fused AutoTP layer"})
    with pytest.raises(CheckpointMismatchError, match=r"parameter 'head.weight' cannot be sliced: a fused AutoTP"):
        convert_for_model_parallel(universal, str(tmp_path / "cut"), layouts, bnb.optim.AdamW8bit, MIN_8BIT_SIZE,
                                   stage=2)


def test_frozen_parameters_and_buffers_are_cut_and_joined_back(one_rank, tmp_path):
    """A model with frozen parameters and a buffer (test_universal_8bit's): each tensor-parallel rank's model states
    hold the buffer whole, its slice of a frozen parameter cut along that parameter's split (here the embedding along
    dim 1) and a replicated one whole, in `module` and as DeepSpeed's frozen fragments; joining the ranks again
    (format/merged.py) gives back the universal checkpoint's tensors exactly. A frozen slice the checkpoint cannot
    give is refused, naming it."""
    from deepspeed_bnb.checkpoint.format.merged import buffers_and_frozen
    from tools.test_universal_8bit import frozen_buffer_engine
    engine = frozen_buffer_engine(0, 2)
    train_steps(engine, range(2))
    engine.save_checkpoint(str(tmp_path / "saved"), tag="t")
    universal = str(tmp_path / "universal")
    export(str(tmp_path / "saved"), universal, universal=True, progress=False)
    buffers, frozen = buffers_and_frozen(UniversalCheckpoint(universal))
    assert set(buffers) == {"scale"} and set(frozen) == {"emb.weight", "ln.weight", "ln.bias"}
    splits = {**SPLITS, "emb.weight": 1, "ln.weight": None, "ln.bias": None}  # the places name the frozen ones too

    def layouts(emb_widths=(20, 20)):
        held = []
        for rank, layout in enumerate(layouts_for(universal, splits=splits)):
            cut = {name: tuple(weights.shape) for name, weights in frozen.items()}
            cut["emb.weight"] = (97, emb_widths[rank])
            held.append((layout.place, layout.shapes, cut, ("scale",)))
        return rank_layouts(held)

    out = str(tmp_path / "cut")
    convert_for_model_parallel(universal, out, layouts(), bnb.optim.AdamW8bit, MIN_8BIT_SIZE, stage=2)
    for rank in range(2):
        states = SavedCheckpoint(out, mp_rank=rank).model_states
        mine = {**frozen, "emb.weight": frozen["emb.weight"].narrow(1, 20 * rank, 20)}
        assert torch.equal(states["module"]["scale"], buffers["scale"])
        for name, expected in mine.items():
            assert torch.equal(states["module"][name], expected), name
            assert torch.equal(states["frozen_param_fragments"][name], expected), name
            assert tuple(states["frozen_param_shapes"][name]) == tuple(expected.shape), name
    joined_buffers, joined_frozen = buffers_and_frozen(open_whole_model(out))
    assert joined_buffers.keys() == buffers.keys() and joined_frozen.keys() == frozen.keys()
    assert all(torch.equal(joined_frozen[n], frozen[n]) for n in frozen) and torch.equal(joined_buffers["scale"],
                                                                                        buffers["scale"])
    with pytest.raises(CheckpointMismatchError, match=r"parameter 'emb.weight' of shape \(97, 40\) cannot give this "
                                                      r"rank the slice"):
        convert_for_model_parallel(universal, str(tmp_path / "bad"), layouts((20, 30)), bnb.optim.AdamW8bit,
                                   MIN_8BIT_SIZE, stage=2)
    assert not os.path.exists(str(tmp_path / "bad"))
