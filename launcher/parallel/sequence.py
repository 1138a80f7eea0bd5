"""Megatron-style sequence parallelism (Korthikanti et al., 2022), applied right after tensor parallelism.

Under tensor parallelism alone, the regions between the split ones (LayerNorms, residual additions, dropout) run on
every rank of the tensor-parallel group, each on the whole sequence. With ``parallel.sequence_parallel`` each rank
keeps only its ``T / tp`` consecutive positions of the hidden states there, and the two communications of each
tensor-parallel region change into their sequence-parallel halves:

- entering a region (q/k/v, fc_in, the output layer): identity forward and all-reduce of the gradient become an
  all-gather along the sequence forward and a reduce-scatter of the gradient;
- leaving it (out_proj, fc_out): all-reduce forward and identity backward become a reduce-scatter along the sequence
  forward and an all-gather of the gradient.

An all-reduce is a reduce-scatter followed by an all-gather, so the volume sent is the same, while the work and the
stored activations of the regions between are divided by ``tp``. The sequence is split once, after the embeddings
(the vocabulary-parallel lookup is all-reduced as before, positions added and dropout applied on the whole sequence,
as Megatron does for learned positions), and gathered once, before the vocabulary-parallel output layer; the loss is
the vocabulary-parallel cross-entropy of the full sequence's logits, unchanged.

Replicated parameters inside the split region (LayerNorm gains and biases, row-parallel biases) now see only this
rank's positions, so their gradients are summed over the tensor-parallel group: a hook on each parameter, which runs
before DDP or DeepSpeed take the gradient, so every engine (DDP, ZeRO 1-3, the pipeline) gets the full gradient. The
position embeddings are used before the split and get the full gradient from the split's backward (an all-gather).

Dropout in the split region draws the mask of the whole sequence from the same random stream as without sequence
parallelism (every rank of the group has the same state) and applies this rank's slice, so sequence parallelism
changes no numerics, dropout included, and the ranks' positions get independent masks.

``parallel.tp_async_grad_reduce`` (:func:`apply_async_grad_reduce`, with or without sequence parallelism) moves the
entry of the MLP and of the output layer into their first product, whose backward overlaps the input gradient's
reduction with the weight gradient's product, as Megatron does.

The helpers take the dimension to split (``dim``): 1 for the model's (batch, sequence, features) activations; FP8 FFNs
use Transformer Engine's own sequence-parallel mode, which gathers the tokens of its 2-D view along dimension 0 (an
FFN is the same function of every token, so it does not matter in which order they are gathered; launcher/fp8.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.parallel.dims import ParallelDims
from launcher.parallel.tensor import shard_of

SEQ_DIM = 1  # the model's activations are (batch, sequence, features)


# ----------------------------------------------------------------------------------------------------------------
# Collectives along one dimension (single collectives on the contiguous layout NCCL and gloo want)


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (a copy, so that the full tensor can be freed)."""
    size = x.shape[dim] // dist.get_world_size(group)
    return x.narrow(dim, dist.get_rank(group) * size, size).contiguous()


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The ranks' slices concatenated along ``dim``, in rank order."""
    parts = dist.get_world_size(group)
    out = torch.empty((parts * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # stacked along dim 0
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(parts, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum over the ranks of ``x``, of which this rank keeps its slice along ``dim``."""
    parts = dist.get_world_size(group)
    chunks = x.unflatten(dim, (parts, x.shape[dim] // parts)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=group)
    return out


def _conjugate(name: str, forward, backward, doc: str) -> type:
    """An autograd function of (x, group, dim) that runs ``forward`` and whose backward runs its conjugate."""

    class Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, dim):
            ctx.group, ctx.dim = group, dim
            return forward(x, group, dim)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group, ctx.dim), None, None

    Conjugate.__name__ = Conjugate.__qualname__ = name
    Conjugate.__doc__ = doc
    return Conjugate


_ScatterToSequence = _conjugate(
    "_ScatterToSequence", _split, _all_gather,
    "This rank's positions forward; the gradients of all positions gathered backward.")
_GatherFromSequence = _conjugate(
    "_GatherFromSequence", _all_gather, _reduce_scatter,
    "Entering a tensor-parallel region: all positions forward; backward, each rank's column-parallel slice gave a "
    "partial gradient for every position, so they are summed and each rank keeps its positions' (reduce-scatter).")
_ReduceScatterToSequence = _conjugate(
    "_ReduceScatterToSequence", _reduce_scatter, _all_gather,
    "Leaving a tensor-parallel region: the row-parallel partial sums added up, this rank's positions kept; backward, "
    "the gradient of all positions (every rank's partial had the same gradient).")


def scatter_to_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    return _ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    return _GatherFromSequence.apply(x, group, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group, dim: int = SEQ_DIM) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, group, dim)


# ----------------------------------------------------------------------------------------------------------------
# Replicated parameters and dropout in the sequence-parallel region


SEQUENCE_PARALLEL_ATTR = "sequence_parallel"  # Megatron's and Transformer Engine's name for the mark


def _summed_over(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.contiguous().clone()  # the incoming gradient may be shared with other autograd inputs
    dist.all_reduce(grad, group=group)
    return grad


def sum_gradient_over_tp(param: nn.Parameter, group) -> None:
    """Make ``param``'s gradient the sum over the tensor-parallel group (each rank saw its own positions only).

    A hook on the parameter runs before the gradient is accumulated into ``.grad``, i.e. before DDP's or DeepSpeed's
    own gradient hooks see it; it runs once per backward with the sum of all of the parameter's uses (activation
    checkpointing included). One small all-reduce per parameter and micro-batch; Megatron instead all-reduces these
    gradients once per step after the backward, which ZeRO-2/3 (gradients partitioned during the backward) does not
    allow without touching DeepSpeed."""
    setattr(param, SEQUENCE_PARALLEL_ATTR, True)
    param.register_hook(functools.partial(_summed_over, group=group))


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, SEQUENCE_PARALLEL_ATTR, False)


class SequenceParallelDropout(nn.Module):
    """Dropout of this rank's positions with its slice of the whole sequence's mask (see the module docstring)."""

    def __init__(self, dropout: nn.Dropout, dims: ParallelDims, dim: int = SEQ_DIM):
        super().__init__()
        self.p, self.tp, self.tp_rank, self.dim = dropout.p, dims.tp, dims.tp_rank, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        full = list(x.shape)
        full[self.dim] *= self.tp
        # F.dropout of ones is the scaled mask nn.Dropout would have drawn for the whole sequence
        mask = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), self.p)
        return x * mask.narrow(self.dim, self.tp_rank * x.shape[self.dim], x.shape[self.dim])


class ScatterAfter(nn.Module):
    """``module`` (the embeddings' dropout), then this rank's positions: where the sequence-parallel region starts."""

    def __init__(self, module: nn.Module, group):
        super().__init__()
        self.module, self.group = module, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence(self.module(x), self.group)


# ----------------------------------------------------------------------------------------------------------------
# Overlap: the column-parallel input gradient reduced while the weight gradient is computed


class _ColumnParallelLinear(torch.autograd.Function):
    """y = x W^T + b of a column-parallel layer that owns its region's entry (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication): forward, x as it is (tensor parallel) or all-gathered along the
    sequence (sequence parallel); backward, the input gradient first, its reduction over the group started
    asynchronously (all-reduce, or reduce-scatter along the sequence), the weight and bias gradients computed while
    it runs, then the wait. Same products and sums as autograd's, in another order."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        total = _all_gather(x, group, SEQ_DIM) if sequence_parallel else x
        ctx.save_for_backward(total, weight)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        total, weight = ctx.saved_tensors
        # under autocast the forward multiplied copies in the autocast dtype, which the gradient has
        grad_total = grad.matmul(weight.to(grad.dtype))
        if ctx.sequence_parallel:
            parts = dist.get_world_size(ctx.group)
            chunks = grad_total.unflatten(SEQ_DIM, (parts, -1)).movedim(SEQ_DIM, 0).contiguous()
            grad_x = torch.empty(chunks.shape[1:], dtype=grad.dtype, device=grad.device)
            work = dist.reduce_scatter_tensor(grad_x, chunks.flatten(0, 1), group=ctx.group, async_op=True)
        else:
            grad_x = grad_total
            work = dist.all_reduce(grad_x, group=ctx.group, async_op=True)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = rows.t().matmul(total.reshape(-1, total.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_bias = rows.sum(0).to(weight.dtype) if ctx.has_bias else None
        work.wait()
        return grad_x, grad_weight, grad_bias, None, None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias, group, sequence_parallel: bool):
    return _ColumnParallelLinear.apply(x, weight, bias, group, sequence_parallel)


def _enter_nothing(x: torch.Tensor, _group) -> torch.Tensor:
    return x  # the region's first layer communicates itself


def apply_async_grad_reduce(model: nn.Module, dims: ParallelDims, sequence_parallel: bool) -> nn.Module:
    """parallel.tp_async_grad_reduce: the entries of each MLP and of the output layer move into their first product,
    fc_in and the vocabulary-parallel head (:class:`_ColumnParallelLinear`).

    Not the attention: its entry stays a separate step, because its q/k/v product is the model's own (one product of
    the three concatenated weights) and its input is what the monitors capture. FP8 FFNs are Transformer Engine's
    modules, whose own overlap options are not wired."""
    linear = functools.partial(column_parallel_linear, group=dims.tp_group, sequence_parallel=sequence_parallel)
    for block in model.blocks:
        block.mlp.tp_enter, block.mlp.fc_in.tp_linear = _enter_nothing, linear
    model.lm_head.tp_enter, model.lm_head.tp_linear = _enter_nothing, linear
    return model


# ----------------------------------------------------------------------------------------------------------------
# The plan


def apply_sequence_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Turn a tensor-split GPT (launcher.parallel.tensor.apply_tensor_parallel) sequence-parallel, in place."""
    if dims.tp == 1:
        raise ValueError("sequence parallelism needs tensor parallelism (parallel.tensor_parallel > 1)")
    group = dims.tp_group
    for block in model.blocks:
        # the regions' communications, set by apply_tensor_parallel, swapped for their sequence-parallel halves
        block.attn.tp_enter = block.mlp.tp_enter = gather_from_sequence
        block.attn.out_proj.tp_exit = block.mlp.fc_out.tp_exit = reduce_scatter_to_sequence
        for owner in (block.attn, block.mlp):
            if owner.dropout.p > 0:
                owner.dropout = SequenceParallelDropout(owner.dropout, dims)
    model.drop = ScatterAfter(model.drop, group)  # positions are added before: their gradient stays whole
    model.lm_head.tp_enter = gather_from_sequence
    for module in (*model.blocks, model.ln_f):
        for param in module.parameters():
            if shard_of(param) is None:  # LayerNorms, row-parallel biases
                sum_gradient_over_tp(param, group)
    return model


def local_seq_len(seq_len: int, dims: ParallelDims, sequence_parallel: bool) -> int:
    """Positions of the hidden states a rank holds between blocks (what crosses a pipeline stage boundary)."""
    return seq_len // dims.tp if sequence_parallel else seq_len
