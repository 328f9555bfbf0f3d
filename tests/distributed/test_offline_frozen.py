"""The offline writers keep frozen parameters at any data-parallel size and stage.

ZeRO-2 and ZeRO-3 saves record the parameters the optimizer does not own (requires_grad=False: a fine-tuning run's
embeddings, a LoRA run's base weights): a ZeRO-3 rank its own slice of each, in its own model-states file, which
DeepSpeed's engine copies into that rank's partition at load and zero_to_fp32 joins; a ZeRO-2 run whole, in its one
model-states file. Source: the 2-rank ZeRO-3 checkpoint with frozen parameters of the shared launches
(distributed_scenarios.ELASTIC_KINDS, fp32_stage3_frozen), whose ranks hold different slices of the frozen embedding
(control: a writer that gave every rank file rank 0's model states would be caught). Written from it offline:
`convert` to bnb's 32-bit AdamW (the same DP size), `reshape` to 1 and 3 ranks (ZeRO-3) and to 2 ranks of ZeRO-2; and
`export` of that ZeRO-2 tag (the layout a ZeRO-2 run of DP 2 writes). Each is held to the frozen weights the saving
engine held (reference_state.pt): DeepSpeed's own zero_to_fp32 of it, `deepspeed-bnb export`, and a one-rank engine's
load of the converted and the 3-rank tags. And a MoE model's frozen expert layers at expert-parallel size 2: `export`
writes every expert's (DeepSpeed's frozen_param_* name rank 0's at most; all are in their expert files).
"""

import os

import pytest
import torch

from support.scenario_runs import SIZES

pytestmark = [pytest.mark.multi_rank,
              pytest.mark.skipif(2 not in SIZES, reason=f"needs the DP-2 checkpoints (scenario sizes {SIZES})")]
KIND = "fp32_stage3_frozen"


@pytest.fixture(scope="module")
def source(scenario_results, scenario_folder):
    folder = os.path.join(scenario_folder, "elastic", KIND, "dp2")
    reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=False)
    frozen = {name: state["frozen"] for name, state in reference.items() if "frozen" in state}
    assert frozen, "the scenario trains with frozen parameters"
    return folder, frozen


@pytest.fixture(scope="module")
def written(source, tmp_path_factory):
    """label -> (folder, tag) of each offline writer's output from the source."""
    from deepspeed_bnb.checkpoint.tools.convert import convert
    from deepspeed_bnb.checkpoint.tools.reshape import reshape
    folder, _ = source
    out = tmp_path_factory.mktemp("frozen")
    tag = os.path.join(folder, "t")
    convert(tag, str(out / "convert32"), "32bit", progress=False)
    reshape(tag, str(out / "dp1"), 1, progress=False)
    reshape(tag, str(out / "dp3"), 3, progress=False)
    reshape(tag, str(out / "dp2_stage2"), 2, progress=False, stage=2)
    return {label: (str(out / label), "t") for label in ("convert32", "dp1", "dp3", "dp2_stage2")}


def test_control_the_source_ranks_hold_different_slices(source):
    folder, frozen = source
    fragments = [torch.load(os.path.join(folder, "t", f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                            weights_only=False)["frozen_param_fragments"] for r in range(2)]
    assert fragments[0]["emb.weight"].numel() == frozen["emb.weight"].numel() // 2
    assert not torch.equal(fragments[0]["emb.weight"], fragments[1]["emb.weight"])


@pytest.mark.parametrize("label", ["source", "convert32", "dp1", "dp3", "dp2_stage2"])
def test_deepspeeds_zero_to_fp32_reads_the_frozen_weights(source, written, label):
    from deepspeed.utils import zero_to_fp32
    folder, frozen = source
    where, tag = (folder, "t") if label == "source" else written[label]
    if label == "dp2_stage2" and not hasattr(zero_to_fp32, "PARAM_ALIGNMENT_PADDINGS"):
        # before 0.19.7 zero_to_fp32 reads a ZeRO-1/2 group's parameters back to back, and a block-aligned layout
        # at DP >= 2 has gaps between them: it stops, as its own sanity check says (docs/checkpoint_format.md)
        with pytest.raises(ValueError, match="numels out of .* something is wrong"):
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(where, tag=tag)
        return
    weights = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(where, tag=tag)
    for name, expected in frozen.items():
        assert torch.equal(weights[name].reshape(-1), expected), name


@pytest.mark.parametrize("label", ["source", "convert32", "dp1", "dp3", "dp2_stage2"])
def test_export_writes_the_frozen_weights(source, written, label, tmp_path):
    from safetensors.torch import load_file

    from deepspeed_bnb.checkpoint.tools.export import export
    folder, frozen = source
    where, tag = (folder, "t") if label == "source" else written[label]
    weights = load_file(export(os.path.join(where, tag), str(tmp_path / "export"), progress=False)["model"])
    for name, expected in frozen.items():
        assert torch.equal(weights[name].reshape(-1), expected), name


@pytest.mark.parametrize("label", ["convert32", "dp3"])
def test_a_one_rank_engine_loads_the_frozen_weights(source, written, label):
    import bitsandbytes as bnb
    import deepspeed

    from support.distributed_scenarios import FROZEN
    from support.toy import MIN_8BIT_SIZE, ds_config, freeze, make_model, param_groups
    _, frozen = source
    model = make_model(seed=1)
    groups = freeze(model, FROZEN, param_groups(model))
    optimizer = bnb.optim.AdamW(groups) if label == "convert32" else \
        bnb.optim.AdamW8bit(groups, min_8bit_size=MIN_8BIT_SIZE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(1, stage=3))
    engine.load_checkpoint(*written[label])
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([params[name] for name in frozen]):
        for name, expected in frozen.items():
            assert torch.equal(params[name].detach().reshape(-1), expected), name


def test_export_writes_every_frozen_expert(scenario_results, scenario_folder, tmp_path):
    """A MoE model's frozen expert layers at expert-parallel size 2 (scenario_moe_frozen_save): DeepSpeed's save names
    only rank 0's experts in frozen_param_* (control); export takes the others from their expert files."""
    from safetensors.torch import load_file

    from deepspeed_bnb.checkpoint.tools.export import export
    from support.distributed_scenarios import MOE_FROZEN
    folder = os.path.join(scenario_folder, MOE_FROZEN, "dp2")
    reference = torch.load(os.path.join(folder, "reference_state.pt"), weights_only=True)
    assert len(reference) == 4  # the first layer of each of the 4 experts
    named = torch.load(os.path.join(folder, "t", "mp_rank_00_model_states.pt"), weights_only=False)
    # control: DeepSpeed's frozen_param_* do not give all four (rank 0's two experts on 0.19.8, none on 0.18.2)
    assert len(named.get("frozen_param_shapes") or {}) < len(reference)
    weights = load_file(export(os.path.join(folder, "t"), str(tmp_path / "export"), progress=False)["model"])
    for name, expected in reference.items():
        assert name in weights and torch.equal(weights[name], expected), name
