"""Plain bitsandbytes' state as the tests compare it: shaped like the state gathered from a ZeRO partition (and that
gathered state of a one-rank engine, by parameter name or by parameter), a one-rank engine held to plain bnb bit for
bit, dequantized by bitsandbytes itself, and how far values came back from a set, in quantization steps of bnb's
maps."""

import bitsandbytes as bnb
import torch

from deepspeed_bnb.checkpoint.format.param_state import gather_param_states
from deepspeed_bnb.ops.reference import code_gap

ROUNDING = 2.0 ** -22  # fp32 slack, relative to the value: the scaled value v * (1 / absmax) and qmap[c] * absmax are
# each rounded (measured without it: up to 0.500004 steps where the map's steps are narrowest relative to the value)


def differing_keys(mine: dict, theirs: dict) -> list:
    """The keys of one parameter's state that are not bit for bit the same (a tensor of another dtype or value, any
    other value unequal); every key of either where the two hold different keys."""
    if mine.keys() != theirs.keys():
        return sorted(set(mine) | set(theirs))
    return [key for key in mine if not (
        torch.is_tensor(theirs[key]) and mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key])
        if torch.is_tensor(mine[key]) else mine[key] == theirs[key])]


def same_state(mine: dict, theirs: dict) -> bool:
    """One parameter's state, bit for bit (differing_keys finds none)."""
    return not differing_keys(mine, theirs)


def assert_same(mine: dict, theirs: dict, label: str):
    """One parameter's state, bit for bit: the same keys, each tensor of the same dtype and equal, the rest equal."""
    differ = differing_keys(mine, theirs)
    assert not differ, f"{label}: {', '.join(map(str, differ))} differ"


def flat_bnb_state(state, numel):
    """Plain bnb's state of one parameter, flattened like the gathered state: (rows..., numel) / (rows..., blocks)."""
    out = {}
    for key, value in state.items():
        if key == "unorm_vec":
            continue  # scratch: written by each step, never carried to the next
        if key in ("state1", "state2"):
            value = value.reshape(-1, numel)  # AdEMAMix keeps two rows (fast and slow EMA)
            value = value[0] if value.shape[0] == 1 else value
        out[key] = value
    return out


def engine_param_states(engine) -> dict:
    """name -> bnb-shaped state of the parameter, from a deepspeed_bnb ZeRO optimizer's records (any stage; DP=1: one
    rank holds all of it)."""
    out = {}
    for record in engine.optimizer._bnb_group_records():
        per_param = gather_param_states(record.layout, record.eight_bit, record.key_classes, [record.state])
        out.update(zip(record.param_names, per_param))
    return out


def flat_param_states(engine) -> dict:
    """model parameter -> bnb-shaped state, gathered from a ZeRO-1/2 engine's flat partitions (DP=1: one rank holds
    all of it)."""
    opt, out = engine.optimizer, {}
    for i, params in enumerate(opt.bnb_params):  # model parameters in flat order
        state = opt.optimizer.state[opt.single_partition_of_fp32_groups[i]]
        per_param = gather_param_states(opt.bnb_layouts[i], opt.bnb_eight_bit[i], opt.bnb.stored_classes(state),
                                        [state])
        out.update({p: s for p, s in zip(params, per_param)})
    return out


def assert_equals_plain(engine, model, reference, plain, label):
    """The ZeRO run's weights and every parameter's state (values and dtypes) equal plain bnb's; returns the state."""
    states = flat_param_states(engine)
    for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach(), q.detach()), f"{label}: weights of {pname} differ"
        assert_same(states[p], flat_bnb_state(plain.state[q], q.numel()), pname)
    return states


def bnb_moments(state: dict, numel: int) -> dict:
    """One parameter's bnb state1/state2 as fp32 (rows, numel): 8-bit codes through bnb's dequantize_blockwise."""
    out = {}
    for i in (1, 2):
        if f"state{i}" not in state:
            continue
        value = state[f"state{i}"]
        value = value.reshape(value.numel() // numel, numel)  # AdEMAMix's state1: two rows
        if value.dtype == torch.uint8:
            absmax = state[f"absmax{i}"].reshape(value.shape[0], -1)
            value = torch.stack([bnb.functional.dequantize_blockwise(codes, absmax=scale, code=state[f"qmap{i}"],
                                                                     blocksize=256)
                                 for codes, scale in zip(value, absmax)])
        out[f"state{i}"] = value
    return out


def assert_holds_moments(state: dict, moments, label: str) -> int:
    """One parameter's bnb `state` against its moments `moments` ([exp_avg, exp_avg_sq], flat fp32; one state's
    [exp_avg] or [momentum_buffer] alike): 32-bit state equal to them, 8-bit codes within one quantization step of
    them (the gap between the two codes around each value, bnb's formula qmap[code] * absmax[element // 256]).
    Returns how many of them are 8-bit."""
    eight_bit = 0
    for i, value in enumerate(moments, start=1):
        held = state[f"state{i}"].reshape(-1)
        if held.dtype != torch.uint8:
            assert torch.equal(held, value), f"{label}.state{i}"
            continue
        eight_bit += 1
        absmax, qmap = state[f"absmax{i}"], state[f"qmap{i}"]
        error = (qmap[held.long()] * absmax[torch.arange(held.numel()) // 256] - value).abs()
        assert (error <= code_gap(value, absmax, qmap)).all(), f"{label}.state{i}"  # within one step
    return eight_bit


def step_ratio(got: torch.Tensor, values: torch.Tensor, unsigned: bool, numel: int) -> float:
    """Largest |got - value| (less fp32 rounding) over the gap between the two codes of bnb's map around the value,
    each 256-element block of each row of `numel` elements scaled by its largest |value| (nearest code: <= 0.5)."""
    qmap = bnb.functional.create_dynamic_map(signed=not unsigned)
    worst = 0.0
    for g, v in zip(got.reshape(-1, numel).cpu(), values.reshape(-1, numel).cpu()):
        absmax = torch.nn.functional.pad(v.abs(), (0, -numel % 256)).view(-1, 256).amax(dim=1)
        gap, error = code_gap(v, absmax, qmap), ((g - v).abs() - ROUNDING * v.abs()).clamp(min=0)
        assert (error[gap == 0] == 0).all(), "a block of zeros must come back exactly"
        if (gap > 0).any():
            worst = max(worst, float((error[gap > 0] / gap[gap > 0]).max()))
    return worst


def stock_moments(engine, names=("exp_avg", "exp_avg_sq")) -> dict:
    """name -> its moments of a one-rank stock ZeRO engine, every row of every state in order (Adam's [exp_avg,
    exp_avg_sq]; AdEMAMix's fast and slow EMA, then its second moment): torch's moments of each flat partition by
    `names` (one per state), or a bitsandbytes optimizer's state1[, state2] of it dequantized by bitsandbytes itself
    (blocks from the partition's first element, per row), cut at DeepSpeed's own places of the parameters in it."""
    opt = engine.optimizer
    numbers = range(1, len(names) + 1)

    def rows(flat, i, numel):  # state i of a flat partition of `numel` elements: (rows, numel)
        key = names[i - 1]
        if key in flat:  # torch's
            return flat[key].reshape(1, -1)
        return bnb_moments(flat, numel)[f"state{i}"]

    out = {}
    if engine.zero_optimization_stage() == 3:  # one rank: each sub-group's parameters whole, back to back
        for i, params in enumerate(opt.fp16_groups):
            partition, offset = opt.fp32_partitioned_groups_flat[i], 0
            flat = opt.optimizer.state[partition]
            for p in params:
                out[opt.param_names[p]] = [row.narrow(0, offset, p.ds_numel).clone() for k in numbers
                                           for row in rows(flat, k, partition.numel())]
                offset += p.ds_numel
        return out
    for g, params in enumerate(opt.bit16_groups):
        partition = opt.single_partition_of_fp32_groups[g]
        flat = opt.optimizer.state[partition]
        for p in params:
            address = p._hp_mapping.get_hp_fragment_address()
            out[opt.param_names[p]] = [row.narrow(0, address.start, address.numel).clone() for k in numbers
                                       for row in rows(flat, k, partition.numel())]
    return out
