"""bitsandbytes 0.49.x (Axolotl pins 0.49.1) on a CPU, where it has no optimizer update of its own.

bnb 0.49's `functional.is_on_gpu` refuses CPU tensors in both of its optimizer updates, and its `get_config` returns
two fields 0.50 dropped (`percentile_clipping`, `block_wise`). deepspeed_bnb then steps every parameter with the fused
kernel (8-bit state, and 32-bit state through the kernel's fp32 path) and refuses, naming the parameters, the bnb
version and the fixes, what the kernel cannot step (deepspeed_bnb/optim/own_update.py, partition_step.py).

Two halves:
- in this venv (bnb 0.50.2), with 0.49's behaviour planted (tests/legacy_bnb.simulate_049): each step of each
  partition is the pure-torch reference's, bit for bit; each 32-bit-state parameter's step is bnb 0.50.2's own 32-bit
  update of the same state up to rounding; the refusals say what they should, and without deepspeed_bnb's check the
  same run fails inside bnb as 0.49 does (control);
- against the real release, when DEEPSPEED_BNB_BNB049_PYTHON names the python of a venv with bnb 0.49.x (else
  skipped, saying how to make one): tests/support/legacy_bnb_runs.py trains at DP=2, saves, loads at DP=1 and trains on,
  in that venv and in this one; every state byte, master weight and loss must be identical (8-bit everywhere: this venv
  unmodified; 32-bit state too: this venv with 0.49's refusal planted, the same code path). Control: this venv's own
  32-bit update does differ from it.
What stays untested without a GPU: bnb 0.49's own CUDA update (on a GPU, "auto" uses the fused kernels only where
their first-use check against that update holds).
"""

import copy
import os
import re
import sys

import bitsandbytes as bnb
import bitsandbytes.functional as F
import deepspeed
import pytest
import torch

from conftest import TESTS, free_port, launch_env, run_or_fail
from deepspeed_bnb.ops import loader, rules
from deepspeed_bnb.optim import own_update
from deepspeed_bnb.optim.fused import contract as fused_contract, partition_step
from deepspeed_bnb.optim.fused.route import FUSED
from deepspeed_bnb.optim.fused.partition_step import NoOwnUpdateError
from support.legacy_bnb import CPU_REFUSAL, legacy_python, simulate_049
from support.legacy_bnb_runs import OPTIMIZERS, REFUSALS, refusals
from support.toy import ds_config, make_model, param_groups, train_steps

pytestmark = pytest.mark.multi_rank
needs_kernel = pytest.mark.skipif(not loader.load(), reason=f"fused kernels unavailable: {loader.error()}")
REPO = os.path.dirname(TESTS)


# ---- the contract: 0.49's get_config --------------------------------------------------------------------------------

def _config_049(factory) -> dict:
    with simulate_049():
        optimizer = factory([torch.nn.Parameter(torch.zeros(300))])
        return optimizer.get_config(0, 0, optimizer.param_groups[0])


@pytest.mark.parametrize("name", ["adamw8bit", "lion8bit", "sgd8bit"])
def test_049_config_at_its_defaults_is_modelled(name):
    """0.49's two extra fields at their defaults (where its update is 0.50's) leave the parameter to the kernel; at
    any other value, or with a field nobody knows (control), bnb's own update is required."""
    config, rule = _config_049(OPTIMIZERS[name]), OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(1))]).optimizer_name
    assert config["percentile_clipping"] == 100 and config["block_wise"] is True
    assert fused_contract.param_reason(rule, config, True) is None
    assert fused_contract.fp32_param_reason(rule, config) is None
    assert "percentile_clipping=5 is not 100" in fused_contract.param_reason(rule, {**config, "percentile_clipping": 5},
                                                                             True)
    assert "block_wise=False" in fused_contract.param_reason(rule, {**config, "block_wise": False}, True)
    assert "'my_field'" in fused_contract.param_reason(rule, {**config, "my_field": 1}, True)
    assert "max_unorm=0.1" in fused_contract.fp32_param_reason(rule, {**config, "max_unorm": 0.1})
    assert "32-bit state" in fused_contract.param_reason(rule, config, False)  # where bnb has its own: bnb's


def test_the_probe_finds_bnb_0_49s_cpu_refusal():
    assert own_update.missing("cpu") is None and own_update.missing(None) is None  # bnb 0.50.2 has a CPU update
    with simulate_049():
        assert re.search(rf"bitsandbytes {re.escape(bnb.__version__)} has no optimizer update on a CPU.*"
                         rf"{CPU_REFUSAL}", own_update.missing("cpu"))
        assert own_update.missing("cuda") is None  # bnb's CUDA kernels are its own update
    assert own_update.missing("cpu") is None


# ---- every step under 0.49's refusal: the reference's, and bnb 0.50.2's 32-bit update up to rounding ---------------

def _copy_state(state: dict) -> dict:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}


def _inputs(call):
    params, grads, state = call["before"]
    return params.clone(), grads.clone(), _copy_state(state)


def _recorded_steps(monkeypatch):
    """Wrap PartitionStep.step: for every call, the partition's inputs and outputs."""
    calls = []
    real = partition_step.PartitionStep.step

    def step(self, group, params, grads, state, inv_scale=None, master_error=None, **kwargs):
        before = (params.detach().clone(), grads.detach().clone(), _copy_state(state))
        written = real(self, group, params, grads, state, inv_scale, master_error, **kwargs)
        calls.append(dict(step=self, group=dict(group), before=before, inv_scale=inv_scale,
                          params=params.detach().clone(), state=_copy_state(state),
                          configs=[self._configs[v] for v in self._fused_variants]))
        return written

    monkeypatch.setattr(partition_step.PartitionStep, "step", step)
    return calls


def _reference_step(call):
    """The pure-torch reference over every segment of the partition, from the recorded inputs."""
    params, grads, state = _inputs(call)
    reference = copy.copy(call["step"].fused)
    reference.use_kernel = False
    reference.step(call["configs"], state["step"] + 1, params, grads, state, call["inv_scale"])
    return params, state


def _bnb_fp32_step(call, lr_factor=1.0):
    """bnb 0.50.2's own update (its real is_on_gpu back in place) of the partition's 32-bit-state segments, from the
    recorded inputs; lr_factor: a wrong teacher, for the control."""
    part = call["step"]
    params, grads, state = _inputs(call)
    if call["inv_scale"] is not None:
        grads.mul_(call["inv_scale"])
    segments = [s for s in part.segments if not s.eight_bit]
    overrides = [part.variants[part.variant[s.slot]] for s in segments]
    group = {**call["group"], "lr": call["group"]["lr"] * lr_factor}
    simulated, F.is_on_gpu = F.is_on_gpu, REAL_IS_ON_GPU
    try:
        part.adapter.step(group, part.gindex, params, grads, state, segments, overrides)
    finally:
        F.is_on_gpu = simulated
    return params, state, segments


REAL_IS_ON_GPU = F.is_on_gpu


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _fp32_gap(call, teacher) -> float:
    """Largest |kernel - bnb| of a 32-bit-state segment's weights, over the step bnb's update moved them by."""
    before, kernel = call["before"][0], call["params"]
    params, _, segments = teacher
    worst = 0.0
    for s in segments:
        mine, theirs, start = (t.narrow(0, s.offset, s.numel) for t in (kernel, params, before))
        moved, gap = (theirs - start).abs().max().item(), (mine - theirs).abs().max().item()
        worst = max(worst, gap / moved if moved else float(gap > 0))
    return worst


CLASSES_049 = ["adamw8bit_mixed", "lion8bit_mixed", "sgd8bit_mixed", "adamw32"]


@needs_kernel
@pytest.mark.parametrize("name", CLASSES_049)
def test_simulated_049_steps_every_parameter_as_the_reference(one_rank, monkeypatch, name):
    """Under 0.49's refusal the kernel steps every parameter, 8-bit and 32-bit state (routes all FUSED), each partition
    step bit-identical to the pure-torch reference; each 32-bit-state parameter's step equals bnb 0.50.2's own 32-bit
    update from the same state within 0.1% of the step (the same rule, rounded differently; measured: at most 5e-5,
    Lion equal), and
    a teacher with a 10% larger lr misses that bar (control)."""
    calls = _recorded_steps(monkeypatch)
    with simulate_049():
        model = make_model(0)
        engine = deepspeed.initialize(model=model, optimizer=OPTIMIZERS[name](param_groups(model)),
                                      config=ds_config(1, stage=2))[0]
        assert set(engine.optimizer.bnb_routes.values()) == {FUSED}
        train_steps(engine, range(3))
        assert len(calls) == 3 * len(engine.optimizer.bnb_steps)
        gaps, wrong = [], []
        for call in calls:
            params, state = _reference_step(call)
            assert torch.equal(_bits(params), _bits(call["params"])), f"{name}: weights differ from the reference"
            for key, value in state.items():
                if torch.is_tensor(value):
                    assert torch.equal(_bits(value), _bits(call["state"][key])), f"{name}: {key} differs"
            assert call["state"]["step"] == call["before"][2]["step"] + 1
            if any(not s.eight_bit for s in call["step"].segments):
                gaps.append(_fp32_gap(call, _bnb_fp32_step(call)))
                wrong.append(_fp32_gap(call, _bnb_fp32_step(call, lr_factor=1.1)))
    assert gaps and max(gaps) < 1e-3, gaps
    assert min(wrong) > 0.05, wrong
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), make_model(0).parameters()))


# ---- what nothing can step: refused by name; without the check, bnb 0.49's own error (control) ---------------------

@needs_kernel
def test_simulated_049_refuses_what_only_bnb_could_step(one_rank):
    with simulate_049():
        raised = refusals()
    version = re.escape(bnb.__version__)
    head = rf"NoOwnUpdateError: deepspeed_bnb: bitsandbytes {version} has no optimizer update on a CPU"
    tail = r"install bitsandbytes 0\.50\.2 .*keep the optimizer step on a GPU"
    assert re.search(head + r".*bnb_fused_kernel is false.*\"auto\" or true.*" + tail, raised["fused_kernel_false"])
    assert re.search(head + r".*'rmsprop' update has no fused kernel.*Lion or SGD with momentum.*" + tail,
                     raised["rmsprop8bit"])
    # the 32-bit parameters of the first param group it meets, by name, with the reason and the fix for them
    assert re.search(head + r".*it cannot step these: emb\.weight, fc1\.weight, fc2\.weight, head\.weight \(param "
                     r"group 0, 32-bit state\): max_unorm=0\.001 is not 0\.0; to step them here, give them 8-bit state "
                     r"\(min_8bit_size=0", raised["trust_ratio_32bit"])
    # control: without deepspeed_bnb's check the run fails inside bnb at its first step, as bnb 0.49 does
    assert raised["unchecked"].startswith(f"RuntimeError: {CPU_REFUSAL}")
    assert "deepspeed_bnb" not in raised["unchecked"]


@needs_kernel
def test_control_with_bnbs_cpu_update_nothing_is_refused(one_rank):
    """The same cases under bnb 0.50.2 as it is: its own CPU update steps them all (so the refusals above come from
    the missing update, not from the configs)."""
    assert refusals() == {case: None for case in REFUSALS}


@needs_kernel
@pytest.mark.parametrize("debug_map", ["kept", "cleared"])
def test_a_per_parameter_override_names_only_that_parameter(one_rank, monkeypatch, debug_map):
    """The refusal names the parameter, also when DeepSpeed's process-wide map of parameter names is emptied while
    the engine is built ("cleared": what an earlier engine's destroy() does when the garbage collector frees it then;
    control: DeepSpeed's own lookup then no longer knows the name)."""
    from deepspeed.utils import debug

    from deepspeed_bnb.runtime.zero import bnb_partitions
    manager = bnb.optim.GlobalOptimManager.get_instance()
    model = make_model(0)
    if debug_map == "cleared":
        adapter = bnb_partitions.BnbAdapter

        def after_clearing(*args, **kwargs):
            debug.debug_clear_module_and_param_names()
            assert debug.debug_param2name(model.fc1.weight) == "unknown"  # control
            return adapter(*args, **kwargs)
        monkeypatch.setattr(bnb_partitions, "BnbAdapter", after_clearing)
    manager.pid2config[id(model.fc1.weight)] = {"skip_zeros": True}  # bnb 0.50 reads pid2config in get_config
    try:
        with simulate_049(), pytest.raises(NoOwnUpdateError) as refused:
            deepspeed.initialize(model=model, optimizer=OPTIMIZERS["adamw8bit"](param_groups(model)),
                                 config=ds_config(1, stage=2))
    finally:
        manager.pid2config.pop(id(model.fc1.weight), None)
    message = str(refused.value)
    assert re.search(r"it cannot step these: fc1\.weight \(param group 0, 8-bit state\): skip_zeros=True is not "
                     r"False; to step them here, give them a config the kernel models\.", message), message


# ---- the real bnb 0.49.x, in its own venv ---------------------------------------------------------------------------

LEGACY, WHY = legacy_python()
LEGACY_VERSION = WHY if LEGACY else None  # legacy_python gives (python, its bnb version) or (None, why not)
needs_legacy = pytest.mark.skipif(LEGACY is None, reason=f"no bitsandbytes 0.49.x venv: {WHY}")
EIGHT_BIT = ["adamw8bit", "lion8bit", "sgd8bit", "lion8bit@offload"]
THIRTY_TWO_BIT = ["adamw8bit_mixed", "lion8bit_mixed", "sgd8bit_mixed", "adamw32", "adamw8bit_mixed@stage3",
                  "adamw8bit_mixed@offload"]
CONTROL = "adamw8bit_mixed"  # in this venv without the simulation: bnb 0.50.2's own 32-bit update


def _env(python) -> dict:
    env = launch_env(python)  # that venv's own JIT cache
    env.update(PYTHONPATH=REPO, DEEPSPEED_BNB_ALLOW_UNTESTED_VERSIONS="1")
    return env


def _launch(python, phase, out, scenarios, nproc=1):
    script = os.path.join(TESTS, "support", "legacy_bnb_runs.py")
    env = _env(python)
    if nproc == 1:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cmd = [python, script, phase, out, *scenarios]
    else:
        cmd = [python, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
               script, phase, out, *scenarios]
    run_or_fail(cmd, env, timeout=1200)
    return torch.load(os.path.join(out, f"{phase}.pt"), weights_only=False)


@pytest.fixture(scope="module")
def legacy_runs(tmp_path_factory):
    """(bnb 0.49 venv's results, this venv's, 0.49's load of this venv's checkpoints): phase -> results."""
    ours_dir, theirs_dir, cross_dir = (str(tmp_path_factory.mktemp(n)) for n in ("bnb050", "bnb049", "cross"))
    theirs_list = EIGHT_BIT + THIRTY_TWO_BIT
    ours_list = EIGHT_BIT + [f"{s}+sim049" for s in THIRTY_TWO_BIT] + [CONTROL]
    theirs = {"save": _launch(LEGACY, "save", theirs_dir, theirs_list, nproc=2)}
    theirs["load"] = _launch(LEGACY, "load", theirs_dir, theirs_list)
    theirs["refuse"] = _launch(LEGACY, "refuse", theirs_dir, [])
    ours = {"save": _launch(sys.executable, "save", ours_dir, ours_list, nproc=2)}
    ours["load"] = _launch(sys.executable, "load", ours_dir, ours_list)
    for scenario in EIGHT_BIT:  # a checkpoint written under 0.50.2, loaded under 0.49
        os.symlink(os.path.join(ours_dir, scenario), os.path.join(cross_dir, scenario))
    cross = _launch(LEGACY, "load", cross_dir, EIGHT_BIT)
    return theirs, ours, cross


def _identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _ours(scenario: str) -> str:
    return scenario if scenario in EIGHT_BIT else f"{scenario}+sim049"


@needs_legacy
@pytest.mark.parametrize("scenario", EIGHT_BIT + THIRTY_TWO_BIT)
def test_049_trains_saves_and_loads_at_another_dp_as_050(legacy_runs, scenario):
    """Trained at DP=2 and saved, loaded at DP=1 and trained on: every optimizer-state byte (codes, absmax, maps,
    fp32 moments, step) and fp32 master weight after the load and at the end, and every loss, equal the same run
    under bnb 0.50.2, bit for bit; every parameter was stepped by the fused kernel."""
    theirs, ours, _ = legacy_runs
    assert theirs["load"]["bnb"] == LEGACY_VERSION and ours["load"]["bnb"] == bnb.__version__ != LEGACY_VERSION
    mine, other = theirs["load"]["scenarios"][scenario], ours["load"]["scenarios"][_ours(scenario)]
    assert set(mine["routes"].values()) == {FUSED.reason} == set(other["routes"].values())
    assert theirs["save"]["scenarios"][scenario]["losses"] == ours["save"]["scenarios"][_ours(scenario)]["losses"]
    assert mine["losses"] == other["losses"]
    assert _identical(mine["loaded"], other["loaded"]), "the loaded state differs"
    assert _identical(mine["final"], other["final"]), "the state after 3 more steps differs"
    assert not _identical(mine["loaded"], mine["final"]), "control: the 3 steps changed the state"


@needs_legacy
def test_control_050s_own_32bit_update_differs(legacy_runs):
    """The comparison sees last-bit differences: this venv's 32-bit update (bnb 0.50.2's own CPU arithmetic, which
    the kernel computes here, or bnb's update itself where the kernel's copy disagrees on this machine), not the
    kernel's IEEE fp32 path that 0.49 gets, gives other bytes than 0.49's run, though close."""
    theirs, ours, _ = legacy_runs
    mine, other = theirs["load"]["scenarios"][CONTROL], ours["load"]["scenarios"][CONTROL]
    assert (mine["arithmetic"], other["arithmetic"]) == (rules.IEEE, rules.BNB_CPU) or \
        "32-bit state (bnb's own 32-bit update)" in other["routes"].values(), (mine["arithmetic"], other)
    assert not _identical(mine["final"], other["final"])
    assert max((mine["final"][k] - other["final"][k]).abs().max().item()
               for k in mine["final"] if mine["final"][k].is_floating_point()) < 1e-3


@needs_legacy
@pytest.mark.parametrize("scenario", EIGHT_BIT)
def test_049_loads_a_checkpoint_written_under_050(legacy_runs, scenario):
    theirs, ours, cross = legacy_runs
    mine, other = cross["scenarios"][scenario], ours["load"]["scenarios"][scenario]
    assert _identical(mine["loaded"], other["loaded"]) and _identical(mine["final"], other["final"])


@needs_legacy
def test_049_refuses_what_only_bnb_could_step(legacy_runs):
    """The real 0.49: the refusals name the version and the fix; without deepspeed_bnb's check, bnb's own error."""
    raised = legacy_runs[0]["refuse"]["refusals"]
    head = f"NoOwnUpdateError: deepspeed_bnb: bitsandbytes {LEGACY_VERSION} has no optimizer update on a CPU"
    for case in ("fused_kernel_false", "rmsprop8bit", "trust_ratio_32bit"):
        assert raised[case].startswith(head) and "install bitsandbytes 0.50.2" in raised[case], raised[case]
    assert "min_8bit_size=0" in raised["trust_ratio_32bit"] and "fc1.weight" in raised["trust_ratio_32bit"]
    assert raised["unchecked"].startswith(f"RuntimeError: {CPU_REFUSAL}"), raised["unchecked"]

