"""The inf/NaN check before an fp16/bf16 ZeRO-1/2 step: deepspeed_bnb's batched check answers as DeepSpeed's own.

DeepSpeed's `has_overflow_partitioned_grads_serial` (seven small operations per gradient piece) is the oracle,
called on the same pieces: finite pieces at the extremes of each dtype (the largest finite values, many of them,
subnormals, signed zeros), pieces with +inf, -inf or NaN anywhere, empty and missing pieces; in a real bf16 engine
with a NaN put into one gradient. Controls: both answers are True in some cases and False in others, and DeepSpeed's
check runs several operations per piece where ours runs a fixed few.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepspeed_bnb  # noqa: F401  (DeepSpeed's classes with deepspeed_bnb's integration, as users get them)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_bnb.runtime.utils import any_inf_or_nan
from deepspeed_bnb.runtime.zero.compat import PADDING_ENV, PADDING_TENSORS, PARAM_PADDING, has_parameter_padding
from deepspeed_bnb.runtime.zero.stage_1_and_2 import BnbZeroOptimizer
from support.overflow_oracle import deepspeeds_answer
from support.toy import ds_config, global_batch, loss_fn, make_model, param_groups

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ours(groups) -> bool:
    answer = any_inf_or_nan((g for group in groups for g in group), "cpu")
    assert answer.shape == (1,) and answer.dtype == torch.bool  # what DeepSpeed's has_overflow reads
    return bool(answer)


def pieces(dtype, seed: int, bad=None):
    """Two param groups of pieces spanning the dtype's range; `bad` (a value) put at a random place of one piece."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    sizes = [1, 255, 257, 4096, 31]  # empty pieces: test_the_batched_check_on_no_pieces_and_on_empty_ones
    group0 = [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g).float())
              .clamp(-info.max, info.max).to(dtype) for n in sizes]
    group1 = [torch.full((100_000,), info.max, dtype=dtype), torch.full((7,), -info.max, dtype=dtype),
              torch.tensor([info.tiny, -info.tiny, 0.0, -0.0, info.smallest_normal / 4], dtype=dtype), None]
    groups = [group0, group1]
    if bad is not None:
        candidates = [(i, j) for i, group in enumerate(groups) for j, p in enumerate(group)
                      if p is not None and p.numel()]
        i, j = candidates[int(torch.randint(len(candidates), (1,), generator=g))]
        piece = groups[i][j]
        piece.view(-1)[int(torch.randint(piece.numel(), (1,), generator=g))] = bad
    return groups


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_batched_check_answers_as_deepspeeds(dtype):
    answers = set()
    for seed in range(6):
        for bad in (None, float("inf"), float("-inf"), float("nan")):
            groups = pieces(dtype, seed, bad)
            expected = deepspeeds_answer(groups)
            assert ours(groups) == expected, (dtype, seed, bad)
            assert expected == (bad is not None)  # the oracle itself: finite extremes pass, any inf/NaN does not
            answers.add(expected)
    assert answers == {True, False}  # control: neither check is constant


def test_the_batched_check_on_no_pieces_and_on_empty_ones():
    for groups in ([[]], [[None, None]], [[torch.empty(0)], [torch.empty(0, dtype=torch.bfloat16)]]):
        assert ours(groups) is False
        try:
            theirs = deepspeeds_answer(groups)
        except RuntimeError:  # before 0.19.8 DeepSpeed's check takes the max of an empty tensor, which torch refuses
            assert any(g is not None and g.numel() == 0 for group in groups for g in group)
            continue
        assert theirs is False


def test_many_of_the_largest_floats_stay_finite_in_fp64():
    """The sum of squares that could overflow: 2^22 values of fp32's largest magnitude (fp32 would give inf)."""
    big = torch.full((1 << 22,), torch.finfo(torch.float32).max)
    assert ours([[big, -big]]) is False and deepspeeds_answer([[big, -big]]) is False
    assert not torch.isfinite(big.pow(2).sum())  # control: in fp32 the same squares overflow


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_few_operations_instead_of_several_per_piece():
    groups = [[torch.randn(300, dtype=torch.bfloat16) for _ in range(200)]]
    with CountOps() as mine:
        ours(groups)
    with CountOps() as theirs:
        deepspeeds_answer(groups)
    assert theirs.count >= 5 * 200  # control: DeepSpeed's check is per piece
    # on a CPU torch runs _foreach_norm as a norm per piece (one operation per piece from torch 2.13, two in 2.6; a GPU
    # takes one launch for all of them); the rest is a fixed few
    assert mine.count <= 2 * 200 + 10, mine.count


@pytest.mark.parametrize("stage,padding", [(2, PARAM_PADDING), (1, PARAM_PADDING), (2, PADDING_TENSORS)])
def test_in_a_bf16_engine_the_check_sees_a_nan_gradient_as_deepspeed_does(one_rank, monkeypatch, stage, padding):
    """ZeRO-2 and 1, the block-aligned layout through DeepSpeed's per-parameter padding and through padding tensors
    (each layout gives DeepSpeed's check other pieces)."""
    import bitsandbytes as bnb
    import deepspeed
    if padding == PARAM_PADDING and not has_parameter_padding():
        pytest.skip("this DeepSpeed release has no per-parameter padding (the padding tensors case runs)")
    monkeypatch.setenv(PADDING_ENV, padding)
    model = make_model(0, dtype=torch.bfloat16)
    engine = deepspeed.initialize(model=model, optimizer=bnb.optim.AdamW8bit(param_groups(model)),
                                  config=ds_config(1, stage=stage, bf16=True))[0]
    assert engine.optimizer.bnb_padding_mode == padding
    optimizer = engine.optimizer
    ours = BnbZeroOptimizer.has_overflow_partitioned_grads_serial
    assert type(optimizer).has_overflow_partitioned_grads_serial is ours
    tokens, targets = global_batch(0)
    found = []
    for poison in (None, float("nan"), float("inf")):
        engine.backward(loss_fn(engine, tokens, targets))
        grads = [g for i in range(len(optimizer.bit16_groups)) for g in optimizer.averaged_gradients[i]]
        if poison is not None:
            grads[len(grads) // 2].view(-1)[0] = poison
        optimizer.check_overflow()
        stock = bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(optimizer))
        found.append((optimizer.overflow, stock))
        engine.step()  # a step with an overflow is skipped, as DeepSpeed skips it
    assert found == [(False, False), (True, True), (True, True)]
