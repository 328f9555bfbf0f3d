"""ZeRO on the CPU: the fused kernel writes the model's copy of the updated weights, and DeepSpeed's conversion pass
after the optimizer does nothing (runtime/zero/lp_copy.py).

Oracle: the same engine with DEEPSPEED_BNB_KERNEL_LP_COPY=0, where DeepSpeed converts every partition itself. Per
configuration (ZeRO-2 with bf16 and fp32 models, ZeRO-3 with bf16 ones, with the optimizer offloaded and without): after
every step, the model's weights (at ZeRO-3 its partitions), the fp32 master partitions and the optimizer state are bit
for bit the oracle's, including across a checkpoint save and load; DeepSpeed's list of master partitions holds the same
tensors after every step; the master's gradient is released as DeepSpeed releases it. Controls: DeepSpeed's copy of each
partition into another tensor runs in the oracle at every step and in ours only at the first step (after which the
kernel writes it); and a kernel that is handed the copy but does not write it leaves stale weights, which the comparison
catches.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepspeed_bnb  # noqa: F401  (DeepSpeed's classes with deepspeed_bnb's integration, as users get them)
from deepspeed_bnb.ops import loader
from deepspeed_bnb.ops.self_check import bits
from deepspeed_bnb.optim.fused import partition as fused_partition
from deepspeed_bnb.runtime.zero import lp_copy
from support.toy import ds_config, global_batch, loss_fn, make_model, param_groups

pytestmark = pytest.mark.skipif(not loader.load(), reason="the C++ kernel could not be built here")
CONFIGS = [pytest.param(stage, offload, dtype, id=f"zero{stage}-{'offload' if offload else 'on_cpu'}-{str(dtype)[6:]}")
           for stage in (2, 3) for offload in (True, False) for dtype in (torch.bfloat16, torch.float32)
           if stage == 2 or dtype == torch.bfloat16]
STEPS = 4


class PartitionCopies(TorchDispatchMode):
    """Counts aten copies from one of the `masters` (fp32 master partitions) into other data: DeepSpeed's conversion of
    a master partition into the model's copy."""

    def __init__(self, masters):
        super().__init__()
        self.masters, self.count = {m.data_ptr() for m in masters}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if src.data_ptr() in self.masters and dst.data_ptr() != src.data_ptr():
                self.count += 1
        return func(*args, **(kwargs or {}))


def build(offload: bool, dtype: torch.dtype, monkeypatch, kernel_copy: bool, stage: int = 2):
    import bitsandbytes as bnb
    import deepspeed
    monkeypatch.setenv(lp_copy.ENV, "1" if kernel_copy else "0")
    model = make_model(0, dtype=dtype)
    config = ds_config(1, stage=stage, bf16=dtype == torch.bfloat16, offload=offload)
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)), config=config)[0]
    assert (engine.optimizer.cpu_offload if stage < 3 else engine.optimizer.offload_optimizer) == offload
    return engine


def masters(optimizer) -> list:
    """The fp32 master partitions (ZeRO-1/2 or ZeRO-3) as DeepSpeed's list holds them."""
    return list(getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_partitioned_groups_flat)


def snapshot(engine) -> list:
    """Bit patterns of the model's weights (ZeRO-3: this rank's partitions of them), the master partitions and every
    state tensor."""
    optimizer = engine.optimizer
    stage3 = hasattr(optimizer, "fp16_partitioned_groups_flat")
    model = optimizer.fp16_partitioned_groups_flat if stage3 else list(engine.module.parameters())
    out = [bits(p.detach().clone()) for p in model]
    for master in masters(optimizer):
        out.append(bits(master.detach().clone()))
        out += [bits(v.clone()) for v in optimizer.optimizer.state[master].values() if torch.is_tensor(v)]
    return out


def train(engine, steps, partition_copies: list = None) -> list:
    optimizer = engine.optimizer
    before = masters(optimizer)
    snapshots = []
    for step in steps:
        tokens, targets = global_batch(step)
        engine.backward(loss_fn(engine, tokens, targets))
        with PartitionCopies(before) as counter:
            engine.step()
        if partition_copies is not None:
            partition_copies.append(counter.count)
        assert all(a is b for a, b in zip(before, masters(optimizer))), "not handed back"
        assert not optimizer.bnb_lp_copies.handed and not optimizer.bnb_lp_copies.written
        if not getattr(optimizer, "cpu_offload", True):  # ZeRO-1/2 releases the master's gradient after its step
            assert all(m.grad is None for m in before)
        snapshots.append(snapshot(engine))
    return snapshots


def assert_same_runs(ours: list, theirs: list, context: str) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs)):
        differing = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
        assert not differing, f"{context}: step {step}: tensors {differing} differ from DeepSpeed's copy's run"


@pytest.mark.parametrize("stage,offload,dtype", CONFIGS)
def test_kernel_copy_equals_deepspeeds(one_rank, monkeypatch, stage, offload, dtype):
    copies = {True: [], False: []}
    runs = {}
    for kernel_copy in (True, False):
        engine = build(offload, dtype, monkeypatch, kernel_copy, stage)
        runs[kernel_copy] = train(engine, range(STEPS), copies[kernel_copy])
    assert_same_runs(runs[True], runs[False], f"ZeRO-{stage}, offload={offload}, {dtype}")
    groups, kept = len(masters(engine.optimizer)), deepspeeds_copies(engine.optimizer)
    # control: DeepSpeed's copy runs at every step in the oracle; in ours at the first step only (its whole copy),
    # except where this release leaves the kernel no copy to write
    assert copies[False] == [groups] * STEPS
    assert copies[True] == [groups] + [kept] * (STEPS - 1)


def deepspeeds_copies(optimizer) -> int:
    """How many partitions DeepSpeed still converts itself after the first step: none, except at ZeRO-1/2 under
    offload on releases without the pinned buffer (0.16), which send the fp32 partition itself."""
    if hasattr(optimizer, "fp16_partitioned_groups_flat"):
        candidates = [lp_copy.zero3_copy(optimizer, i) for i in range(len(optimizer.fp16_groups))]
    else:
        candidates = [lp_copy.zero12_copy(optimizer, i) for i in range(len(optimizer.bit16_groups))]
        if optimizer.cpu_offload and not hasattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups"):
            assert not any(c is not None for c in candidates)
            return len(candidates)
    assert all(c is not None for c in candidates)  # the toy model's partitions on the CPU: all written by the kernel
    return 0


@pytest.mark.parametrize("stage", [2, 3])
def test_across_a_checkpoint(one_rank, monkeypatch, tmp_path, stage):
    """A load hands the first step after it to DeepSpeed's whole copy again; the runs stay bit for bit the oracle's."""
    runs = {}
    for kernel_copy in (True, False):
        engine = build(True, torch.bfloat16, monkeypatch, kernel_copy, stage)
        before = train(engine, range(2))
        engine.save_checkpoint(str(tmp_path / f"{stage}{kernel_copy}"), tag="t")
        train(engine, range(2, 3))  # a step the load then undoes
        engine.load_checkpoint(str(tmp_path / f"{stage}{kernel_copy}"), tag="t")
        assert not engine.optimizer.bnb_lp_copies.whole
        counts = []
        runs[kernel_copy] = before + train(engine, range(2, 5), counts)
        groups, kept = len(masters(engine.optimizer)), deepspeeds_copies(engine.optimizer)
        assert counts == ([groups, kept, kept] if kernel_copy else [groups] * 3)
    assert_same_runs(runs[True], runs[False], "across a checkpoint")


def test_control_a_copy_left_unwritten_is_caught(one_rank, monkeypatch):
    """A kernel handed the copy that does not write it: DeepSpeed's statement still does nothing, the model's weights
    go stale, and the comparison with the oracle fails."""
    oracle = train(build(False, torch.bfloat16, monkeypatch, False), range(STEPS))
    real = fused_partition.FusedPartition.step

    def without_copy(self, *args, lp_params=None, **kwargs):
        return real(self, *args, **kwargs)
    monkeypatch.setattr(fused_partition.FusedPartition, "step", without_copy)
    broken = train(build(False, torch.bfloat16, monkeypatch, True), range(STEPS))
    with pytest.raises(AssertionError, match="differ from DeepSpeed's copy's run"):
        assert_same_runs(broken, oracle, "planted")


def test_setting_is_checked(monkeypatch):
    monkeypatch.setenv(lp_copy.ENV, "yes")
    with pytest.raises(ValueError, match=f"{lp_copy.ENV}='yes'.*1 .*gpu .*or 0"):
        lp_copy.enabled()


def test_setting_per_device(monkeypatch):
    """1 (the default): the CPU kernels write the copy, the CUDA ones only once a GPU run has measured it
    (MEASURED_ON_GPU); gpu: both; 0: neither."""
    monkeypatch.delenv(lp_copy.ENV, raising=False)
    assert lp_copy.enabled("cpu") and lp_copy.enabled("cuda") == lp_copy.MEASURED_ON_GPU
    for measured in (False, True):  # once a GPU run has measured it, 1 asks the CUDA kernels too
        monkeypatch.setattr(lp_copy, "MEASURED_ON_GPU", measured)
        for value, cpu, cuda in (("1", True, measured), ("gpu", True, True), ("0", False, False)):
            monkeypatch.setenv(lp_copy.ENV, value)
            assert (lp_copy.enabled("cpu"), lp_copy.enabled("cuda")) == (cpu, cuda), (value, measured)


def test_gpu_copy_waits_for_its_first_use_check(monkeypatch):
    """On a GPU the kernel is handed the copy only under =gpu and once its rule's first-use check of the copy has held
    (fp32 master weights, the partition's arithmetic); where the check fails, DeepSpeed copies, after one warning per
    optimizer that names the difference. On the CPU no check is asked. (The copy on the GPU is a stand-in: the gate
    reads its device only; the partition's whole copy is behind it, so the copy is handed over where allowed.)"""
    from types import SimpleNamespace
    from deepspeed_bnb.ops import self_check
    asked, verdict = [], [None]

    def disagreement(*args, **kwargs):
        asked.append((args, kwargs))
        return verdict[0]
    monkeypatch.setattr(self_check, "disagreement", disagreement)
    step = SimpleNamespace(adapter=SimpleNamespace(optimizer_name="adam"), arithmetic="bnb_cuda")
    optimizer = SimpleNamespace(bnb_steps=[step])
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    copies = lp_copy.LpCopies(whole={0})
    monkeypatch.setattr(lp_copy, "MEASURED_ON_GPU", False)
    for value in ("0", "1"):
        monkeypatch.setenv(lp_copy.ENV, value)
        assert copies.target(optimizer, 0, on_gpu) is None and not asked, value
    monkeypatch.setenv(lp_copy.ENV, "gpu")
    assert copies.target(optimizer, 0, on_gpu) is on_gpu
    assert asked == [(("adam", on_gpu.device, "fp32", "bnb_cuda"), {"lp_copy": True})]
    verdict[0] = "after step 2, lp_params differs (planted)"
    with pytest.warns(RuntimeWarning, match=r"first-use check on cuda:0 \(after step 2, lp_params differs \(planted"):
        assert copies.target(optimizer, 0, on_gpu) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        assert copies.target(optimizer, 0, on_gpu) is None
    asked.clear()
    on_cpu = torch.zeros(4, dtype=torch.bfloat16)
    assert copies.target(optimizer, 0, on_cpu) is on_cpu and not asked


def test_no_copy_where_the_model_partition_is_the_master(one_rank, monkeypatch):
    """Where the model's partition and the master are one tensor (DeepSpeed's ZeRO-3 under torch autocast), there is
    no copy to write: DeepSpeed's statement copies it onto itself, the kernel is not asked to."""
    engine = build(False, torch.float32, monkeypatch, True, stage=3)
    optimizer = engine.optimizer
    model, master = optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat[0]
    own = model[0]
    try:
        # control: a model partition of its own is written by the kernel (set here: some releases, 0.18.2 among them,
        # already make an fp32 model's partition the master itself at one rank)
        model[0] = master.clone()
        assert lp_copy.zero3_copy(optimizer, 0) is model[0]
        model[0] = master
        assert lp_copy.zero3_copy(optimizer, 0) is None
        model[0] = master.view(torch.int32).view(torch.float32)  # the same bytes, another tensor
        assert lp_copy.zero3_copy(optimizer, 0) is None
    finally:
        model[0] = own


@pytest.mark.parametrize("offload", [False, True])
def test_master_partitions_mid_step(one_rank, monkeypatch, offload):
    """Mid-step, while a group's entry of DeepSpeed's list is lent to the model's copy, bnb_master_partitions() still
    names every master partition (what tools that count tensors during a step read). Under offload on a release
    without the pinned buffer (DeepSpeed 0.16 sends the fp32 partition itself) the kernel writes no copy: there the
    list keeps its masters throughout the step."""
    engine = build(offload, torch.bfloat16, monkeypatch, True)
    optimizer = engine.optimizer
    own = masters(optimizer)
    assert len(own) >= 2
    train(engine, range(1))  # DeepSpeed's whole copy
    lends = not deepspeeds_copies(optimizer)
    seen = []
    real = type(optimizer)._optimizer_step

    def recording(self, group_no):
        seen.append((group_no, [a is b for a, b in zip(self.single_partition_of_fp32_groups, own)],
                     [a is b for a, b in zip(self.bnb_master_partitions(), own)]))
        return real(self, group_no)
    monkeypatch.setattr(type(optimizer), "_optimizer_step", recording)
    train(engine, range(1, 2))
    # control: group 0's entry is lent out during group 1's step, where the kernel writes the copy
    assert seen[1][0] == 1 and seen[1][1][0] is not lends
    assert all(all(kept) for _, kept, _ in seen) is not lends
    assert all(all(named) for _, _, named in seen)
