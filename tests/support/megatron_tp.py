"""Megatron-style tensor-parallel layers inside a DeepSpeed PipelineModule: the 3D layout (pipeline x tensor x data
parallel) that Megatron-DeepSpeed trains with, built from DeepSpeed's own topology, for the layout-change tests.

DeepSpeed's AutoTP does not run inside a PipelineModule, so a run that is tensor- and pipeline-parallel at once cuts
its layers itself, as Megatron-LM does: a column-parallel linear holds rows [r*n/T, (r+1)*n/T) of the weight and of
the bias, a row-parallel one columns of the weight and the whole bias, each weight marked with Megatron's attributes
(`tensor_model_parallel`, `partition_dim`, `partition_stride`), which DeepSpeed's gradient-norm code and
deepspeed_bnb's record of the split both read. The pipeline's grid is DeepSpeed's PipeModelDataParallelTopology with
a "model" axis; its slice-parallel group is the tensor-parallel group. With one tensor-parallel rank the layers are
plain linears of the whole shapes, under the same parameter names: the whole model the checkpoints are joined into.
"""

import torch
from torch import nn


class TensorParallel:
    """This rank's tensor-parallel size, rank and group (the group is filled in once the PipelineModule built the
    grid; None at size 1)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank, self.group = size, rank, None


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the tensor-parallel ranks (Megatron's f)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The partial outputs summed over the tensor-parallel ranks; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _slice(full: torch.Tensor, tp: TensorParallel, dim: int) -> nn.Parameter:
    """This rank's slice of `full` along `dim`, marked the way Megatron-LM marks tensor-parallel parameters."""
    param = nn.Parameter(full.chunk(tp.size, dim)[tp.rank].clone())
    if tp.size > 1:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
    return param


class ParallelMLP(nn.Module):
    """h + out(tanh(fc(h))): fc column-parallel (weight and bias cut along dim 0), out row-parallel (weight cut along
    dim 1, bias whole); every tensor-parallel rank draws the whole weights from the same seed and keeps its slice."""

    def __init__(self, hidden: int, width: int, tp: TensorParallel):
        super().__init__()
        if width % tp.size:
            raise ValueError(f"width {width} does not divide into {tp.size} tensor-parallel slices")
        fc, out = nn.Linear(hidden, width), nn.Linear(width, hidden)
        self.tp = tp
        self.fc_weight, self.fc_bias = _slice(fc.weight.data, tp, 0), _slice(fc.bias.data, tp, 0)
        self.out_weight, self.out_bias = _slice(out.weight.data, tp, 1), nn.Parameter(out.bias.data.clone())

    def forward(self, h):
        x = h if self.tp.size == 1 else _CopyToTensorParallel.apply(h, self.tp)
        partial = nn.functional.linear(torch.tanh(nn.functional.linear(x, self.fc_weight, self.fc_bias)),
                                       self.out_weight)
        if self.tp.size > 1:
            partial = _ReduceFromTensorParallel.apply(partial, self.tp)
        return h + partial + self.out_bias
