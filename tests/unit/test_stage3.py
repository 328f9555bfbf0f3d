"""ZeRO-3 on one CPU rank: routing, bnb's own arithmetic per parameter, block-aligned partitions, what is refused.

Each case runs through deepspeed.initialize with `"stage": 3` (tests/support/toy.py's model) and compares with plain
bitsandbytes on a copy of the model (`bnb_fused_kernel: false`), or with ZeRO-2 (the default path, whose kernel
relation to bnb tests/kernels/test_matches_bnb.py holds). Multi-rank ZeRO-3 (DP 2 and 3 against DP 1, zero.Init,
sub-groups, offload, stock control, elastic checkpoints) runs in tests/distributed/test_distributed.py and
tests/distributed/test_elastic.py.
"""

import bitsandbytes as bnb
import deepspeed
import pytest
import torch

import deepspeed_bnb  # noqa: F401
from support.async_io import require_aio
from support.bnb_optimizers import FACTORIES
from support.bnb_state import assert_same, engine_param_states as states, flat_bnb_state
from deepspeed_bnb.checkpoint.format.errors import CheckpointMismatchError
import deepspeed.runtime.zero.stage3 as ds_stage3
from deepspeed_bnb import installer
from deepspeed_bnb.runtime.engine import stock_deepspeed
from deepspeed_bnb.runtime.zero.partition_parameters import is_block_aligned
from deepspeed_bnb.runtime.zero.stage3 import BnbZeroStage3Optimizer
from deepspeed_bnb.state_layout import round_up
from support.toy import (clone, ds_config, gathered_weights as weights, make_model, param_groups, train_plain,
                         train_steps)

STEPS = 3


def engine_of(factory, model, stage=3, **zero):
    config = {**ds_config(1, stage=stage, **zero), "zero_force_ds_cpu_optimizer": False}  # client optimizer offloaded
    return deepspeed.initialize(model=model, optimizer=factory(param_groups(model)), config=config)[0]


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "AdEMAMix8bit", "AdamW_32bit"])
def test_stage3_dp1_equals_plain_bnb(one_rank, name):
    """bnb's own update under ZeRO-3: weights and every parameter's state equal plain bnb's, bit for bit."""
    model = make_model(0)
    reference = clone(model)
    engine = engine_of(FACTORIES[name], model, bnb_fused_kernel=False)
    assert isinstance(engine.optimizer, BnbZeroStage3Optimizer)
    plain = FACTORIES[name](param_groups(reference))
    train_steps(engine, range(STEPS))
    train_plain(reference, plain)
    mine, trained = states(engine), weights(engine)
    for pname, q in reference.named_parameters():
        assert torch.equal(trained[pname], q.detach()), f"{name}: weights of {pname} differ"
        assert_same(mine[pname], flat_bnb_state(plain.state[q], q.numel()), f"{name}: {pname}")
    assert not torch.equal(trained["fc1.weight"], make_model(0).fc1.weight.detach())  # it trained


def test_stage3_default_equals_stage2_default(one_rank):
    """The default path (fused kernel where the contract allows, bnb elsewhere) steps ZeRO-3 partitions as it steps
    ZeRO-2's: the same weights and state bytes. Control: another lr changes them."""
    runs = {}
    for stage, lr in ((2, 1e-3), (3, 1e-3), (3, 2e-3)):
        model = make_model(0)
        engine = deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model, lr=lr)),
                                      config=ds_config(1, stage=stage))[0]
        assert "fused kernel (C++)" in engine.optimizer.bnb_update_summary()
        train_steps(engine, range(STEPS))
        runs[(stage, lr)] = weights(engine), states(engine)
    for (w2, s2), (w3, s3) in [(runs[(2, 1e-3)], runs[(3, 1e-3)])]:
        for name in w2:
            assert torch.equal(w2[name], w3[name]), name
            assert_same(s3[name], s2[name], name)
    assert not torch.equal(runs[(3, 2e-3)][0]["fc1.weight"], runs[(3, 1e-3)][0]["fc1.weight"])


def test_stage3_per_parameter_overrides_match_plain_bnb(one_rank):
    """The 32-bit embedding override HF Trainer registers (register_module_override(module, "weight",
    {"optim_bits": 32})) gives that parameter fp32 state under ZeRO-3, as in plain bnb. Control: without it, 8-bit."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    found = {}
    try:
        for override in (True, False):
            model = make_model(0)
            reference = clone(model)
            for m in (model, reference):
                manager.initialize()
                if override:
                    manager.register_module_override(m.emb, "weight", {"optim_bits": 32})
                if m is model:
                    engine = engine_of(FACTORIES["AdamW8bit"], model, bnb_fused_kernel=False)
                else:
                    plain = FACTORIES["AdamW8bit"](param_groups(reference))
            train_steps(engine, range(STEPS))
            train_plain(reference, plain)
            mine, trained = states(engine), weights(engine)
            for pname, q in reference.named_parameters():
                assert torch.equal(trained[pname], q.detach()), pname
                assert_same(mine[pname], flat_bnb_state(plain.state[q], q.numel()), pname)
            found[override] = mine["emb.weight"]["state1"].dtype
    finally:
        manager.initialize()
    assert found == {True: torch.float32, False: torch.uint8}


def test_only_bnb_parameters_get_block_aligned_partitions(one_rank):
    """Parameters a bnb optimizer steps are partitioned in whole 256-element blocks; a torch optimizer's engine keeps
    DeepSpeed's own partitions (control)."""
    bnb_engine = engine_of(FACTORIES["AdamW8bit"], make_model(0))
    torch_model = make_model(0)
    torch_engine = deepspeed.initialize(model=torch_model, optimizer=torch.optim.AdamW(torch_model.parameters()),
                                        config=ds_config(1, stage=3))[0]
    for p in bnb_engine.module.parameters():
        assert is_block_aligned(p) and p.partition_numel() == round_up(p.ds_numel, 256)
    for p in torch_engine.module.parameters():
        assert not is_block_aligned(p) and p.partition_numel() == p.ds_numel


def test_routing_cannot_fail_silently(one_rank, monkeypatch):
    """Should DeepSpeed build its stage-3 optimizer by another route than the module-level name deepspeed_bnb swaps,
    initialize raises, naming the DeepSpeed version and what changed. Control: the normal route."""
    assert isinstance(engine_of(FACTORIES["AdamW8bit"], make_model(0)).optimizer, BnbZeroStage3Optimizer)
    stock = installer.stock("DeepSpeedEngine._configure_zero_optimizer")
    stock_class = ds_stage3.DeepSpeedZeroOptimizer_Stage3

    def another_route(self, optimizer):
        ours, ds_stage3.DeepSpeedZeroOptimizer_Stage3 = ds_stage3.DeepSpeedZeroOptimizer_Stage3, stock_class
        try:
            return stock(self, optimizer)
        finally:
            ds_stage3.DeepSpeedZeroOptimizer_Stage3 = ours

    monkeypatch.setitem(installer._STOCK, "DeepSpeedEngine._configure_zero_optimizer", another_route)
    with pytest.raises(RuntimeError, match=rf"DeepSpeed {deepspeed.__version__} built "
                                           r"deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 .*AdamW8bit"):
        engine_of(FACTORIES["AdamW8bit"], make_model(0))


@pytest.mark.parametrize("zero,named", [
    (dict(zero_quantized_weights=True), "zero_quantized_weights"),
])
def test_unsupported_stage3_settings_are_refused_by_name(one_rank, zero, named):
    with pytest.raises(NotImplementedError, match=f"{named} is not supported .*AdamW8bit under ZeRO stage 3"):
        engine_of(FACTORIES["AdamW8bit"], make_model(0), **zero)


def test_hpz_is_refused_on_releases_whose_hpz_partitioning_fails_on_block_padding(one_rank, monkeypatch):
    """DeepSpeed before 0.19.5 narrows at a start past a parameter's end for a secondary chunk wholly in its padding
    (measured on 0.16.4 at DP 4, hpZ 2: IndexError in Init._partition_param_sec, stock padding never makes such a
    chunk): refused at build, naming the key and the release. Here the release check is made to say "before"."""
    from deepspeed_bnb.runtime.zero import compat
    assert compat.partitions_empty_secondary_chunks("0.19.5") and not compat.partitions_empty_secondary_chunks("0.19.4")
    monkeypatch.setattr(compat, "partitions_empty_secondary_chunks", lambda: False)
    with pytest.raises(NotImplementedError, match=r"zero_hpz_partition_size 2\) with the bitsandbytes optimizer "
                                                  r"AdamW8bit needs DeepSpeed 0.19.5 or later"):
        engine_of(FACTORIES["AdamW8bit"], make_model(0), zero_hpz_partition_size=2)


@pytest.mark.parametrize("master", ["bf16", "bf16+8"])
def test_a_weight_set_on_nvme_with_bf16_master_weights_reaches_the_next_steps(one_rank, tmp_path, monkeypatch,
                                                                           master):
    """bf16 and compensated master weights with the optimizer on NVMe (tests/distributed/test_nvme.py trains and
    resumes them on 2 ranks): DeepSpeed's safe_set_full_fp32_param on a sub-group that lives on NVMe (compensated:
    its master partition and error terms brought in and written back) reads back, and steps on, as with CPU offload,
    bit for bit. Controls: the sub-group was out of memory before the set; the set changed the weights."""
    require_aio()  # DeepSpeed's NVMe swapper: skipped, naming libaio, where it cannot be built
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
    from support import nvme_scenarios as scenarios
    monkeypatch.setattr(scenarios, "MASTER", master)
    runs = {}
    for kind in ("cpu", "opt_nvme"):
        engine = scenarios.build(kind, str(tmp_path))
        scenarios.train(engine, range(2), 1, 0)
        if kind == "opt_nvme":
            swapped, _, out = scenarios.released(engine)
            assert swapped > 0 and out  # control: on NVMe, out of memory
        weight = engine.module[0].weight
        before = safe_get_full_fp32_param(weight)
        safe_set_full_fp32_param(weight, before + torch.linspace(-1e-3, 1e-3, before.numel()).view_as(before))
        after_set = safe_get_full_fp32_param(weight)
        scenarios.train(engine, range(2, 4), 1, 0)
        runs[kind] = (before, after_set, scenarios.weights(engine))
    (before, after_set, final), (nvme_before, nvme_after_set, nvme_final) = runs["cpu"], runs["opt_nvme"]
    assert not torch.equal(after_set, before)  # control: the set changed the weights
    assert torch.equal(nvme_before, before) and torch.equal(nvme_after_set, after_set)
    for name, tensor in final.items():
        assert torch.equal(nvme_final[name], tensor), name


def test_parameter_state_api_gives_the_moments_as_at_stage_2(one_rank, tmp_path):
    """DeepSpeed's safe_get/set_{full,local}_optimizer_state under ZeRO-3 give what they give at ZeRO-2 for the same
    trained state (dequantized moments by bnb's and torch's names), a set comes back within half a quantization step
    and reaches the next checkpoint, which loads into ZeRO-2. Control: stock ZeRO-3 hands out codes."""
    from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                 safe_get_local_optimizer_state, safe_set_full_optimizer_state)
    from support.toy import moment_values
    engines = {}
    for stage in (2, 3):
        engines[stage] = engine_of(FACTORIES["AdamW8bit"], make_model(0), stage=stage, bnb_fused_kernel=False)
        train_steps(engines[stage], range(STEPS))
    two, three = (dict(engines[s].module.named_parameters()) for s in (2, 3))
    for name in two:
        for key in ("exp_avg", "exp_avg_sq", "state1"):
            full = safe_get_full_optimizer_state(three[name], key)
            assert torch.equal(full, safe_get_full_optimizer_state(two[name], key)), f"{name}.{key}"
            assert torch.equal(safe_get_local_optimizer_state(three[name], key), full.flatten()), f"{name}.{key}"
    assert torch.equal(safe_get_full_fp32_param(three["fc1.weight"]), weights(engines[3])["fc1.weight"])
    with pytest.raises(ValueError, match="absmax1"):
        safe_get_full_optimizer_state(three["fc1.weight"], "absmax1")

    target = moment_values("fc1.weight.exp_avg", three["fc1.weight"].ds_shape)
    safe_set_full_optimizer_state(three["fc1.weight"], target, "exp_avg")
    got = safe_get_full_optimizer_state(three["fc1.weight"], "exp_avg")
    assert (got - target).abs().max() > 0 and (got - target).abs().max() <= target.abs().max() / 127  # quantized
    engines[3].save_checkpoint(str(tmp_path), tag="set")
    back = engine_of(FACTORIES["AdamW8bit"], make_model(1), stage=2, bnb_fused_kernel=False)
    back.load_checkpoint(str(tmp_path), tag="set")
    assert torch.equal(safe_get_full_optimizer_state(back.module.fc1.weight, "exp_avg"), got)

    with stock_deepspeed():
        model = make_model(0)
        config = {**ds_config(1, stage=3), "zero_allow_untested_optimizer": True}
        stock = deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](param_groups(model)),
                                     config=config)[0]
    train_steps(stock, range(1))
    codes = safe_get_full_optimizer_state(stock.module.fc1.weight, "state1")
    assert torch.equal(codes, codes.round()) and codes.max() > 1  # code numbers, not moments


def frozen_engine(seed, vocab, stage=3):
    """The toy model with its embedding frozen (requires_grad=False, not in the optimizer)."""
    model = make_model(seed)
    model.emb = torch.nn.Embedding(vocab, model.emb.embedding_dim)
    model.emb.weight.requires_grad_(False)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in param_groups(model)]
    return deepspeed.initialize(model=model, optimizer=FACTORIES["AdamW8bit"](groups),
                                config=ds_config(1, stage=stage))[0]


def test_frozen_parameter_of_another_shape_is_refused_before_anything_loads(one_rank, tmp_path):
    """A frozen parameter whose saved size differs from the engine's is refused by name, and the engine is unchanged
    (DeepSpeed would have loaded the trained weights first). Control: the same checkpoint loads into the model it
    was saved from, frozen weights included."""
    from support.toy import VOCAB
    saver = frozen_engine(0, VOCAB)
    train_steps(saver, range(STEPS))
    saver.save_checkpoint(str(tmp_path), tag="t")
    other = frozen_engine(1, VOCAB + 3)
    before = weights(other)
    with pytest.raises(CheckpointMismatchError, match=r"frozen parameter 'emb.weight' has 3880 elements there and "
                       r"4000 in this engine's model"):
        other.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(before[n], w) for n, w in weights(other).items())
    same = frozen_engine(1, VOCAB)
    same.load_checkpoint(str(tmp_path), tag="t")
    assert all(torch.equal(weights(saver)[n], w) for n, w in weights(same).items())


def test_frozen_parameters_saved_at_stage_2_load_into_stage_3(one_rank, tmp_path):
    """Stage 1/2 saves frozen weights whole in the module; a ZeRO-3 engine takes them (its own slice of each), the
    trained state as saved. Control: the loading engine's own frozen weights differ."""
    from support.toy import VOCAB
    saver = frozen_engine(0, VOCAB, stage=2)
    train_steps(saver, range(STEPS))
    saver.save_checkpoint(str(tmp_path), tag="t")
    loader = frozen_engine(1, VOCAB)
    assert not torch.equal(weights(loader)["emb.weight"], weights(saver)["emb.weight"])
    loader.load_checkpoint(str(tmp_path), tag="t")
    saved, loaded = weights(saver), weights(loader)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[n], loaded[n]) for n in saved)
    for name, state in states(saver).items():
        assert_same(states(loader)[name], state, name)


def test_nvme_offload_at_stage_2_is_cpu_offload_and_says_so(one_rank, tmp_path, monkeypatch):
    """DeepSpeed's ZeRO-1/2 take offload_optimizer.device "nvme" as CPU offload: deepspeed_bnb says so (naming the
    path and stage 3) instead of letting it pass silently. Control: nothing is written under the path."""
    from deepspeed_bnb.runtime import engine as ours
    said = []
    monkeypatch.setattr(ours.logger, "warning", lambda message, *a, **k: said.append(message))
    nvme = tmp_path / "nvme"
    engine = engine_of(FACTORIES["AdamW8bit"], make_model(0), stage=2,
                       offload_optimizer={"device": "nvme", "nvme_path": str(nvme)})
    assert engine.optimizer.cpu_offload and not nvme.exists()
    assert any("keep the optimizer state in host memory (CPU offload)" in m and str(nvme) in m
               and "zero_optimization.stage 3" in m for m in said), said
