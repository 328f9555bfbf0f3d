"""Block-aligned ZeRO-3 parameter partitions for the parameters a bitsandbytes optimizer steps.

`deepspeed.runtime.zero.partition_parameters.Init._padding_size` pads every parameter to a multiple of the partition
world size, so rank r's slice starts at r * ceil(numel / world): inside a 256-element quantization block in general,
and bnb state cut there would depend on the DP size. A parameter marked here (BLOCK_ALIGNED_ATTR, set by the bnb ZeRO-3
optimizer on the parameters it steps) is padded to a multiple of `BLOCK_SIZE * world` instead; every other parameter,
and every engine without a bnb optimizer, keeps DeepSpeed's padding. DeepSpeed sizes partitions, all-gather buffers
and checkpoints from `_padding_size` (through `aligned_size()` / `ds_tensor.ds_numel`), with two exceptions:
- single-parameter all-gathers (`_all_gather_sequential`) size their output as `ceil(numel / world) * world`: the
  wrapped `_dist_allgather_fn` below gathers such a call into a full-size buffer and copies the prefix it needs;
- ZeRO-3's gradient reduce-scatter chunks each gradient by `ceil(numel / world)`: runtime/zero/stage3.py pads the
  gradients of marked parameters first;
- on one rank nothing is gathered: `NoGatherHandle` / `NoGatherCoalescedHandle` view the whole partition as the
  parameter, so for marked parameters they are handed the partition without its padding (`_unpadded`).
Parameters that `zero.Init` already partitioned (HF's `from_pretrained` under ZeRO-3) are gathered and partitioned
again, one at a time, when the optimizer marks them (`block_align`).

One fix of DeepSpeed itself, for releases before 0.19.8 on gloo: `Init._allgather_params_coalesced` (a synchronous
all-gather of several parameters: persistent parameters at initialize and after every checkpoint, GatheredParameters)
launches one asynchronous all-gather per parameter and waits on the last handle only. On NCCL the stream orders them;
gloo runs each asynchronous collective on its own, so the others may still be writing when the parameters are used:
garbage weights now and then, more often on a busy machine (measured: DeepSpeed 0.17.2, 2 ranks, ZeRO-3, under load,
one run in four produced NaN or off losses). DeepSpeed 0.19.8 waits on every handle; before it, the wrapper below
makes each of those all-gathers finish before it returns (`_FinishedGathers`).
"""

import importlib

import torch
import torch.distributed
from deepspeed import comm as dist

from deepspeed_bnb.installer import stock, swapped
from deepspeed_bnb.runtime.zero.compat import waits_every_gather_handle
from deepspeed_bnb.state_layout import BLOCK_SIZE, round_up

PARTITION_MODULE = "deepspeed.runtime.zero.partition_parameters"
BLOCK_ALIGNED_ATTR = "ds_bnb_block_aligned"  # parameter attribute: True once its partitions are block-aligned


def is_block_aligned(param) -> bool:
    return bool(getattr(param, BLOCK_ALIGNED_ATTR, False))


def _padding_size(self, param):
    if is_block_aligned(param):
        return round_up(param.ds_numel, BLOCK_SIZE * _partition_world_size(self, param)) - param.ds_numel
    return stock("Init._padding_size")(self, param)


def _partition_world_size(init, param) -> int:
    # DeepSpeed 0.19.3 added per-parameter partition groups (expert parameters); before, every parameter is
    # partitioned over `num_partitions` ranks
    size = getattr(init, "_partition_world_size", None)
    return size(param) if size is not None else init.num_partitions


class _Completed:
    """The handle of a collective that already finished (what DeepSpeed's AllGatherHandle waits on)."""

    def wait(self):
        return None

    def is_completed(self):
        return True


class _FinishedGathers:
    """deepspeed.comm as partition_parameters uses it, whose all-gathers have finished when they return."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _finished(self, name, *args, **kwargs):
        handle = getattr(self._comm, name)(*args, **kwargs)
        if handle is not None:
            handle.wait()
        return _Completed()

    def all_gather_into_tensor(self, *args, **kwargs):
        return self._finished("all_gather_into_tensor", *args, **kwargs)

    def all_gather(self, *args, **kwargs):
        return self._finished("all_gather", *args, **kwargs)


def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
    gather = stock("Init._allgather_params_coalesced")
    if waits_every_gather_handle() or not param_list or torch.distributed.get_backend() != "gloo":
        return gather(self, param_list, hierarchy, quantize)
    comm = importlib.import_module(PARTITION_MODULE).dist  # what DeepSpeed's function calls now
    with swapped("partition_parameters.dist", _FinishedGathers(comm)):  # see the module docstring
        return gather(self, param_list, hierarchy, quantize)


def _dist_allgather_fn(input_tensor, output_tensor, group=None):
    world = dist.get_world_size(group=group)
    if output_tensor.numel() >= input_tensor.numel() * world:
        return stock("partition_parameters._dist_allgather_fn")(input_tensor, output_tensor, group)
    # `_all_gather_sequential` sized `output_tensor` for DeepSpeed's padding, shorter than a block-aligned
    # parameter's partitions: gather all of them (synchronously) and keep the prefix, which holds the parameter.
    full = torch.empty(input_tensor.numel() * world, dtype=output_tensor.dtype, device=output_tensor.device)
    stock("partition_parameters._dist_allgather_fn")(input_tensor, full, group).wait()
    output_tensor.copy_(full.narrow(0, 0, output_tensor.numel()))
    return _Completed()


class _unpadded:
    """Within the block, marked parameters' `ds_tensor` is their partition without the padding (one rank only:
    the partition is the whole parameter, padded to whole blocks)."""

    def __init__(self, params):
        self.params = [p for p in params if is_block_aligned(p) and p.ds_tensor.numel() != p.ds_numel]

    def __enter__(self):
        self.padded = [p.ds_tensor for p in self.params]
        for param in self.params:
            param.ds_tensor = param.ds_tensor.narrow(0, 0, param.ds_numel)

    def __exit__(self, *exc):
        for param, padded in zip(self.params, self.padded):
            param.ds_tensor = padded


def _no_gather_init(self, param):
    with _unpadded([param]):
        stock("NoGatherHandle.__init__")(self, param)


def _no_gather_coalesced_init(self, params):
    with _unpadded(params):
        stock("NoGatherCoalescedHandle.__init__")(self, params)


@torch.no_grad()
def block_align(params) -> int:
    """Mark `params` for block-aligned partitions. Those DeepSpeed already partitioned with its own padding (under
    `zero.Init`) are gathered and partitioned again, one at a time (a collective: every rank passes the same list in
    the same order). Returns how many were re-partitioned."""
    repartitioned = 0
    for param in params:
        if is_block_aligned(param):
            continue
        if getattr(param, "ds_tensor", None) is None:  # not converted yet: partitioned block-aligned when it is
            setattr(param, BLOCK_ALIGNED_ATTR, True)
            continue
        param.all_gather()  # with DeepSpeed's padding, before the mark changes it
        setattr(param, BLOCK_ALIGNED_ATTR, True)
        param.ds_tensor = None  # the old partition: `partition()` allocates one of the new size
        # hpZ's secondary partition too: `_partition_param_sec` keeps one it finds, at its old (stock-padded) size,
        # and the next gather from secondary partitions would mix the two sizes
        if getattr(param, "ds_secondary_tensor", None) is not None:
            param.ds_secondary_tensor = None
        param.partition()
        repartitioned += 1
    return repartitioned
