"""The inf/NaN check before an fp16/bf16 ZeRO-1/2 step: deepspeed_bnb's batched check answers as DeepSpeed's own;
and, with the optimizer offloaded to the CPU, the per-parameter tests and norms DeepSpeed reads back one by one.

DeepSpeed's `has_overflow_partitioned_grads_serial` (seven small operations per gradient piece) is the oracle,
called on the same pieces: finite pieces at the extremes of each dtype (the largest finite values, many of them,
subnormals, signed zeros), pieces with +inf, -inf or NaN anywhere, empty and missing pieces; in a real bf16 engine
with a NaN put into one gradient. Controls: both answers are True in some cases and False in others, and DeepSpeed's
check runs several operations per piece where ours runs a fixed few.
Under offload: a NaN or inf put into one gradient is seen as DeepSpeed sees it, backward reads nothing back to the
host (DeepSpeed >= 0.17.1; before, as much as stock) where a stock engine reads once per parameter (the control),
and the gradient norm equals DeepSpeed's own method's on the same state, its loop reading host copies made in one
transfer.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deepspeed_bnb  # noqa: F401  (DeepSpeed's classes with deepspeed_bnb's integration, as users get them)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed_bnb.runtime.utils import any_inf_or_nan, inf_or_nan_term, on_host
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


def test_sparse_pieces_answer_as_their_dense_twins():
    """A sparse gradient (an embedding's, where the model makes them) is judged by its stored values; the oracle is
    DeepSpeed's check of the same tensor made dense."""
    answers = set()
    for bad in (None, float("inf"), float("nan")):
        values = torch.tensor([1.0, -2.0, 3e38])
        if bad is not None:
            values[1] = bad
        piece = torch.sparse_coo_tensor(torch.tensor([[0, 5, 9]]), values, (12,))
        expected = deepspeeds_answer([[piece.to_dense()]])
        assert ours([[piece]]) == expected == (bad is not None)
        assert bool(inf_or_nan_term(piece).isfinite()) != expected
        answers.add(expected)
    assert answers == {True, False}


def test_many_of_the_largest_floats_stay_finite_in_fp64():
    """The sum of squares that could overflow: 2^22 values of fp32's largest magnitude (fp32 would give inf)."""
    big = torch.full((1 << 22,), torch.finfo(torch.float32).max)
    assert ours([[big, -big]]) is False and deepspeeds_answer([[big, -big]]) is False
    terms = torch.stack([inf_or_nan_term(torch.cat([big[:2], -big[:2]]))] * 1000)  # the widest span, many times
    assert bool(terms.sum().isfinite())
    assert not torch.isfinite(big.pow(2).sum())  # control: in fp32 the same squares overflow


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_the_cpu_every_position_of_a_bad_value_is_seen(dtype, threads):
    """The CPU judges a piece by its smallest and largest values (torch.aminmax): an inf or NaN at the first and last
    positions and inside vector bodies, tails and each thread's chunk, against DeepSpeed's check of the same pieces."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for size in (1, 2, 15, 16, 17, 33, 64, 65, 129, 4097, 65_537):
            for position in sorted({0, 1 % size, size // 2, size - 17 if size > 17 else 0, size - 1}):
                for bad in (float("nan"), float("inf"), float("-inf")):
                    piece = torch.randn(size).to(dtype)
                    piece[position] = bad
                    groups = [[torch.randn(300).to(dtype), piece]]
                    assert ours(groups) is deepspeeds_answer(groups) is True, (size, position, bad)
                    # the offloaded step's per-gradient term (backward), summed with a finite one
                    assert not bool((inf_or_nan_term(piece) + inf_or_nan_term(groups[0][0])).isfinite())
            finite = torch.randn(size).to(dtype)
            assert ours([[finite]]) is False and bool(inf_or_nan_term(finite).isfinite())
    finally:
        torch.set_num_threads(before)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_cpu_uses_the_extremes_only_where_its_probe_saw_them_propagate(monkeypatch):
    """The CPU's check by torch.aminmax holds only if torch propagates a NaN to the bounds; a probe asks once per
    process. Control: an aminmax that drops NaNs (as a reduction that skips them would) fails the probe, and the fp64
    norms answer instead, still as DeepSpeed does; without the probe that aminmax would have missed the NaN."""
    from deepspeed_bnb.runtime import utils
    groups = pieces(torch.bfloat16, 0, float("nan"))
    monkeypatch.setattr(utils, "_EXTREMES_PROBED", [])
    assert utils._extremes_see_nan() is True and utils._EXTREMES_PROBED == [True]  # torch's own aminmax, here
    with CountOps() as used:
        assert ours(groups) is True
    assert "aminmax" in used.names and "_foreach_norm" not in used.names
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda x: real(torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)))
    monkeypatch.setattr(utils, "_EXTREMES_PROBED", [True])  # the broken reduction trusted: the NaN is missed
    assert ours(groups) is False
    monkeypatch.setattr(utils, "_EXTREMES_PROBED", [])  # probed: refused, and the fp64 norms answer
    assert utils._extremes_see_nan() is False and utils._EXTREMES_PROBED == [False]
    with CountOps() as used:
        assert ours(groups) is True
    assert "aminmax" not in used.names and "_foreach_norm" in used.names
    for seed in range(3):
        for bad in (None, float("inf"), float("nan")):
            groups = pieces(torch.float16, seed, bad)
            assert ours(groups) == deepspeeds_answer(groups) == (bad is not None)

    def unsupported(x):  # a torch whose CPU aminmax lacks a dtype
        raise RuntimeError(f"aminmax not implemented for {x.dtype}")
    monkeypatch.setattr(torch, "aminmax", unsupported)
    monkeypatch.setattr(utils, "_EXTREMES_PROBED", [])
    assert ours(pieces(torch.bfloat16, 1, float("inf"))) is True and utils._EXTREMES_PROBED == [False]


def test_a_few_operations_instead_of_several_per_piece():
    groups = [[torch.randn(300, dtype=torch.bfloat16) for _ in range(200)]]
    with CountOps() as mine:
        ours(groups)
    with CountOps() as theirs:
        deepspeeds_answer(groups)
    assert theirs.count >= 5 * 200  # control: DeepSpeed's check is per piece
    # on a CPU one aminmax per piece (a GPU takes one _foreach_norm launch for all of them); the rest is a fixed few
    assert mine.count <= 2 * 200 + 10, mine.count


# the layouts this release offers (per-parameter padding arrived in DeepSpeed 0.19.7; padding tensors work everywhere):
# collected per release, so that the compatibility matrix, which counts a skip as a failure, sees no skip
LAYOUTS = ([(2, PARAM_PADDING), (1, PARAM_PADDING)] if has_parameter_padding() else []) + [(2, PADDING_TENSORS)]


@pytest.mark.parametrize("stage,padding", LAYOUTS)
def test_in_a_bf16_engine_the_check_sees_a_nan_gradient_as_deepspeed_does(one_rank, monkeypatch, stage, padding):
    """ZeRO-2 and 1, the block-aligned layout through DeepSpeed's per-parameter padding and through padding tensors
    (each layout gives DeepSpeed's check other pieces)."""
    import bitsandbytes as bnb
    import deepspeed
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


def host_reads(mode) -> int:
    return mode.ops.get("aten._local_scalar_dense", 0) + mode.ops.get("aten.item", 0)


class CountByName(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def bf16_checks_overflow_key() -> bool:
    """Whether this DeepSpeed has `bf16.check_grad_overflow` (0.17.1 on; before it a bf16 step never checks for inf
    and NaN, and with offload one with a NaN gradient fails in DeepSpeed's own norm)."""
    try:
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    except ImportError:
        return False
    return "check_grad_overflow" in getattr(DeepSpeedBF16Config, "model_fields", {})


def offload_engine(stock: bool):
    import bitsandbytes as bnb
    import deepspeed
    model = make_model(0, dtype=torch.bfloat16)
    optimizer = (torch.optim.AdamW(param_groups(model), lr=1e-3) if stock
                 else bnb.optim.AdamW8bit(param_groups(model)))
    config = ds_config(1, stage=2, bf16=True, offload=True)
    if bf16_checks_overflow_key():  # on by default only from 0.19.3
        config["bf16"]["check_grad_overflow"] = True
    engine = deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]
    assert isinstance(engine.optimizer, BnbZeroOptimizer) != stock and engine.optimizer.cpu_offload
    return engine


# DeepSpeed before 0.17.1 tests offloaded gradients in update_overflow_tracker_for_param_grad, which deepspeed_bnb
# leaves as it is: there backward reads as much as a stock engine's, and only the answers are compared
BATCHED_TRACKER = hasattr(DeepSpeedZeroOptimizer, "update_offload_overflow_tracker")


def test_under_offload_backward_reads_nothing_back_and_sees_a_bad_gradient(one_rank):
    tokens, targets = global_batch(0)
    reads = {}
    poisons = (None, float("nan"), float("inf")) if bf16_checks_overflow_key() else (None, None)
    for stock in (True, False):
        engine = offload_engine(stock)
        optimizer = engine.optimizer
        # the model's own parameters (DeepSpeed's groups may hold padding tensors too, which get no gradient)
        params = [p for p in engine.module.parameters() if p.requires_grad]
        found = []
        for poison in poisons:
            hook = None
            if poison is not None:  # one element of one parameter's gradient, as backward produces it
                hook = params[len(params) // 2].register_hook(lambda g, v=poison: g.index_fill(0, torch.tensor([0]), v))
            with CountByName() as mode:
                engine.backward(loss_fn(engine, tokens, targets))
            reads.setdefault(stock, []).append(host_reads(mode))
            if hook is not None:
                hook.remove()
            before = [p.detach().clone() for p in params]
            engine.step()
            found.append((optimizer.overflow, all(torch.equal(a, b) for a, b in zip(before, params))))
        # no overflow: a step that moved the weights; NaN or inf in one gradient: the step skipped, weights as they were
        assert found == [(False, False) if p is None else (True, True) for p in poisons], (stock, found)
    assert min(reads[True]) >= len(params)  # control: DeepSpeed reads back each parameter's test
    if BATCHED_TRACKER:
        assert max(reads[False]) == 0, reads[False]
    else:
        assert reads[False] == reads[True], reads


def test_under_offload_the_norm_is_deepspeeds_from_host_copies(one_rank, monkeypatch):
    engine = offload_engine(stock=False)
    optimizer = engine.optimizer
    tokens, targets = global_batch(1)
    engine.backward(loss_fn(engine, tokens, targets))
    norms = dict(optimizer.norm_for_param_grads)
    assert len(norms) > 1
    seen = []
    stock_norm = DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload

    def watching(self, params):  # DeepSpeed's own loop, with what it finds in norm_for_param_grads recorded
        seen.append(dict(self.norm_for_param_grads))
        return stock_norm(self, params)
    for i, params in enumerate(optimizer.params_in_partition):
        expected = stock_norm(optimizer, params)
        monkeypatch.setattr(DeepSpeedZeroOptimizer, "complete_grad_norm_calculation_for_cpu_offload", watching)
        got = optimizer.complete_grad_norm_calculation_for_cpu_offload(params)
        monkeypatch.setattr(DeepSpeedZeroOptimizer, "complete_grad_norm_calculation_for_cpu_offload", stock_norm)
        # a 0-dim tensor (a Python float before DeepSpeed 0.17): the same value and type
        assert type(got) is type(expected), (i, got, expected)
        assert (torch.equal(got, expected) and got.dtype == expected.dtype) if torch.is_tensor(got) \
            else got == expected, (i, got, expected)
        copies = seen[-1]
        assert list(copies) == list(norms)  # every parameter's, in DeepSpeed's order
        assert all(torch.equal(copies[k], norms[k]) and copies[k] is not norms[k] for k in norms)
        assert len({t.untyped_storage().data_ptr() for t in copies.values()}) == 1  # one transfer
        assert optimizer.norm_for_param_grads is not copies  # DeepSpeed's own dict is back after the call
    # control: DeepSpeed's own norms are separate tensors (read one by one without the override)
    assert len({t.untyped_storage().data_ptr() for t in norms.values()}) == len(norms)
    engine.step()


def test_host_copies_of_mixed_values_are_refused():
    assert on_host({}) is None
    assert on_host({1: torch.tensor(1.0), 2: torch.tensor(2.0, dtype=torch.float64)}) is None
    assert on_host({1: torch.tensor([1.0])}) is None
    copies = on_host({3: torch.tensor(1.5, dtype=torch.float64), 1: torch.tensor(-2.0, dtype=torch.float64)})
    assert list(copies) == [3, 1] and [float(v) for v in copies.values()] == [1.5, -2.0]
