"""Bytes a ZeRO rank holds, by role, measured from the live tensors' storages (every storage counted once).

Roles, in the order a storage is claimed (a storage reachable from two roles counts for the first):
- weights: the model's parameters and the flat buffers ZeRO packs them into (replicated on every rank at stages 1/2;
  at stage 3 this rank's partitions `ds_tensor` in `lp_param_buffer`, plus the persistent parameters kept whole);
- master: ZeRO's master partition (`single_partition_of_fp32_groups`; stage 3: `fp32_partitioned_groups_flat`), fp32
  or bf16, and deepspeed_bnb's error terms of compensated master weights (`bnb_master_errors`);
- state: the base optimizer's `state` tensors (exp_avg/exp_avg_sq, or bnb's codes, absmax and maps);
- buckets: the buffers of ZeRO's gradient-reduction buckets (`ipg_buckets`), a fixed size set by
  `reduce_bucket_size` (gradients waiting in a bucket live in this buffer, so they count here);
- gradients: `.grad`/`grad_accum` of the parameters and of the master partition, and every tensor under a ZeRO
  optimizer attribute whose name mentions "grad" (averaged/accumulated gradient partitions).
Storages rather than tensors: a view keeps its whole buffer alive, and that is what occupies memory.
"""

import gc
from collections.abc import Iterable, Iterator

import torch

ROLES = ("weights", "master", "state", "buckets", "gradients")


def _key(t: torch.Tensor):
    return t.device, t.untyped_storage().data_ptr()


def _real(t) -> bool:
    # meta tensors (ZeRO keeps shape-only copies) own no memory
    return torch.is_tensor(t) and t.device.type != "meta" and t.untyped_storage().nbytes() > 0


def walk(obj, depth: int = 5, seen=None) -> Iterator[torch.Tensor]:
    """Tensors (and their .grad) reachable through dicts, lists, tuples and plain objects' attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if torch.is_tensor(obj):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from walk(child, depth - 1, seen)


def storage_bytes(tensors: Iterable) -> dict[tuple, int]:
    return {_key(t): t.untyped_storage().nbytes() for t in tensors if _real(t)}


def state_bytes_by_key(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state per state key, summed over its parameters (shared tensors counted once)."""
    seen, by_key = set(), {}
    for state in optimizer.state.values():
        for name, value in state.items():
            if _real(value) and _key(value) not in seen:
                seen.add(_key(value))
                by_key[name] = by_key.get(name, 0) + value.untyped_storage().nbytes()
    return by_key


def _buffers(bucket) -> list:
    """A reduction bucket's buffers: a list at ZeRO-1/2, one flat tensor at ZeRO-3 (iterated, it would be split into
    one tensor per element)."""
    return list(bucket.buffer) if isinstance(bucket.buffer, (list, tuple)) else [bucket.buffer]


def role_tensors(engine) -> dict[str, list]:
    zero, params = engine.optimizer, list(engine.module.parameters())
    # mid-step, deepspeed_bnb's ZeRO-1/2 lends a group's entry of single_partition_of_fp32_groups to the model's copy
    # (runtime/zero/lp_copy.py): its own list of the master partitions holds them throughout
    masters = (zero.bnb_master_partitions() if hasattr(zero, "bnb_master_partitions") else
               list(getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat))
    grads = [t for p in params + masters for t in (p.grad, getattr(p, "grad_accum", None)) if t is not None]
    masters += [e for e in getattr(zero, "bnb_master_errors", ()) if e is not None]
    grads += [t for name, value in vars(zero).items() if "grad" in name.lower() for t in walk(value)]
    partitions = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]  # ZeRO-3
    lp_buffer = [zero.lp_param_buffer] if torch.is_tensor(getattr(zero, "lp_param_buffer", None)) else []
    return {
        "weights": params + list(getattr(zero, "bit16_groups_flat", [])) + partitions + lp_buffer,
        "master": masters,
        "state": [v for s in zero.optimizer.state.values() for v in s.values()],
        "buckets": [t for bucket in getattr(zero, "ipg_buckets", {}).values() for t in _buffers(bucket)],
        "gradients": grads,
    }


def census(engine) -> dict[str, int]:
    """Bytes per role on this rank, right now."""
    claimed, out = set(), {}
    for role, tensors in role_tensors(engine).items():
        mine = {k: n for k, n in storage_bytes(tensors).items() if k not in claimed}
        claimed.update(mine)
        out[role] = sum(mine.values())
    return out


def live_storages() -> dict[tuple, int]:
    """Every storage of a tensor object alive in the process (gc sees all Python tensor objects)."""
    gc.collect()
    return storage_bytes(o for o in gc.get_objects() if torch.is_tensor(o))


def unclaimed_bytes(engine, baseline=()) -> int:
    """Bytes of live tensors that no role claims and that were not alive before (`baseline`): what the roles miss."""
    claimed = set(baseline)
    for tensors in role_tensors(engine).values():
        claimed.update(storage_bytes(tensors))
    return sum(n for k, n in live_storages().items() if k not in claimed)


# ZeRO methods between which gradients change hands (bucket reduction, the end-of-backward epilogue, the step's
# flatten/free/update); the sampler looks before and after each.
SAMPLED_METHODS = ("reduce_ipg_grads", "copy_grads_in_partition", "independent_gradient_partition_epilogue",
                   "_clear_param_grad_only", "free_grad_in_param_list", "_optimizer_step",
                   "partition_grads", "_prepare_fp32_grad_for_sub_group")  # the last two: ZeRO-3


class PeakSampler:
    """Samples the census after each gradient lands (autograd hooks) and around ZeRO's gradient methods; keeps maxima.

    Gradients live only transiently (ZeRO-2 frees them bucket by bucket; the step flattens a copy of the partition's
    gradient), so their peak is the maximum over these sampling points: a lower bound of the true peak, which a
    tensor created and freed between two points could exceed.
    """

    def __init__(self, engine, baseline=()):
        self.engine, self.baseline = engine, baseline
        self.peak, self.where, self.unclaimed = dict.fromkeys(ROLES, 0), dict.fromkeys(ROLES, ""), 0
        self.handles = [p.register_post_accumulate_grad_hook(lambda _: self.sample("backward (gradient hook)"))
                        for p in engine.module.parameters() if p.requires_grad]
        zero = engine.optimizer
        self.wrapped = [name for name in SAMPLED_METHODS if hasattr(zero, name)]
        for name in self.wrapped:
            setattr(zero, name, self._sampled(getattr(zero, name), name))

    def _sampled(self, method, name):
        def wrapper(*args, **kwargs):
            self.sample(f"before {name}")
            if name == "_optimizer_step":  # mid-step everything is allocated: look for tensors the roles miss
                self.unclaimed = max(self.unclaimed, unclaimed_bytes(self.engine, self.baseline))
            out = method(*args, **kwargs)
            self.sample(f"after {name}")
            return out
        return wrapper

    def sample(self, where: str):
        for role, n in census(self.engine).items():
            if n > self.peak[role]:
                self.peak[role], self.where[role] = n, where

    def close(self):
        for handle in self.handles:
            handle.remove()
        for name in self.wrapped:
            delattr(self.engine.optimizer, name)  # back to the class's methods
