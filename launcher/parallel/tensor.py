"""Megatron-style tensor parallelism applied from outside to the plain single-device GPT.

Each block's attention and MLP are split over the ``tp`` ranks of a tensor-parallel group (Shoeybi et al., 2019):

- ``q_proj``, ``k_proj``, ``v_proj`` and ``mlp.fc_in`` are column-parallel: rank r keeps rows
  [r*n/tp, (r+1)*n/tp) of the weight, i.e. whole heads (heads H*r/tp .. H*(r+1)/tp - 1) and a slice of the FFN;
- ``out_proj`` and ``mlp.fc_out`` are row-parallel: rank r keeps the matching input columns, and the partial
  products are summed with one all-reduce;
- the token embedding is split by vocabulary (each rank looks up the ids in its range, the rows are summed), and the
  tied output layer produces each rank's vocabulary slice of the logits; the cross-entropy combines them without
  ever gathering the full logits.

Two conjugate autograd functions carry the communication: ``copy_to_tp`` (identity forward, all-reduce of the
gradient backward) on the input of each split region (the attention, the MLP, the output layer), ``reduce_from_tp``
(all-reduce forward, identity backward) after every row-parallel output. The attention's q, k and v projections
share one ``copy_to_tp`` (a forward pre-hook on the attention module), so its backward is one all-reduce, as with
Megatron's fused QKV matrix. Replicated parameters (LayerNorms, position embeddings, row-parallel
biases) therefore receive identical gradients on every rank of the group. The functions a region enters and leaves
with are attributes (``tp_enter`` of the attention, the MLP and the output layer, ``tp_exit`` of the row-parallel
layers): sequence parallelism (launcher/parallel/sequence.py) swaps in its all-gather and reduce-scatter.

The split modules keep the original names (``blocks.1.attn.q_proj.weight``), and each sharded parameter records
how it was split (:class:`Shard`), so checkpoints can be written as full tensors and loaded under any layout.

We write these few modules instead of using torch's DTensor-based ``parallelize_module``: DeepSpeed's ZeRO and
pipeline engines partition and communicate plain ``torch.Tensor`` parameters and do not accept DTensors, and the
attention kernel needs the global head index of its local heads, which a module plan alone does not provide.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.config import check_divisible
from launcher.parallel.dims import ParallelDims


@dataclass(frozen=True)
class Shard:
    """How a parameter is split over the tensor-parallel group: along ``dim`` into ``parts`` equal slices."""

    dim: int
    parts: int

    def slice(self, full: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        size = full.shape[self.dim] // self.parts
        return full.narrow(self.dim, index * size, size)


SHARD_ATTR = "tp_shard"


def mark_sharded(param: nn.Parameter, shard: Shard) -> nn.Parameter:
    """Record the split on the parameter. ``tensor_model_parallel`` is the attribute DeepSpeed reads so that its global
    gradient norm sums sharded parameters over the group and counts replicated ones once."""
    setattr(param, SHARD_ATTR, shard)
    param.tensor_model_parallel = True
    return param


def shard_of(param: torch.Tensor) -> Optional[Shard]:
    return getattr(param, SHARD_ATTR, None)


# ----------------------------------------------------------------------------------------------------------------
# Communication with autograd


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    t = t.contiguous()
    dist.all_reduce(t, group=group)
    return t


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the gradient is summed over the group (each rank used the input for its own slice)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sum of the ranks' partial results forward; identity backward (every rank's partial had the same gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTensorParallel.apply(x, group)


# ----------------------------------------------------------------------------------------------------------------
# Split modules


def _shard_param(full: torch.Tensor, shard: Shard, index: int) -> nn.Parameter:
    return mark_sharded(nn.Parameter(shard.slice(full.detach(), index).clone()), shard)


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r with W_r this rank's rows of W; the output stays split (the caller's heads/FFN slice).
    The input must have passed ``copy_to_tp`` (the plan puts it on the enclosing attention or MLP module)."""

    def __init__(self, full: nn.Linear, dims: ParallelDims):
        super().__init__()
        shard = Shard(0, dims.tp)
        self.in_features, self.out_features = full.in_features, full.out_features // dims.tp
        self.weight = _shard_param(full.weight, shard, dims.tp_rank)
        self.bias = None if full.bias is None else _shard_param(full.bias, shard, dims.tp_rank)
        # parallel.tp_async_grad_reduce swaps in a product that owns the region's communication, overlapping it with
        # the weight gradient in the backward (launcher/parallel/sequence.py)
        self.tp_linear = F.linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b with W_r this rank's input columns of W; x_r is the split output of the layer before."""

    def __init__(self, full: nn.Linear, dims: ParallelDims):
        super().__init__()
        self.in_features, self.out_features = full.in_features // dims.tp, full.out_features
        self.weight = _shard_param(full.weight, Shard(1, dims.tp), dims.tp_rank)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())  # replicated
        self.group = dims.tp_group
        self.tp_exit = reduce_from_tp  # sequence parallelism swaps in a reduce-scatter (launcher/parallel/sequence.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp_exit(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary: rank r holds ids [r*V/tp, (r+1)*V/tp) and contributes their rows."""

    def __init__(self, full: nn.Embedding, dims: ParallelDims):
        super().__init__()
        self.num_embeddings = full.num_embeddings // dims.tp
        self.vocab_start = dims.tp_rank * self.num_embeddings
        self.weight = _shard_param(full.weight, Shard(0, dims.tp), dims.tp_rank)
        self.group = dims.tp_group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.group)


class VocabParallelHead(nn.Module):
    """The tied output layer: this rank's vocabulary slice of the logits, from the embedding's own weight shard."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.weight = embedding.weight  # the same Parameter: tied, as in the single-device model
        self.group = embedding.group
        self.tp_enter = copy_to_tp  # sequence parallelism swaps in an all-gather (launcher/parallel/sequence.py)
        self.tp_linear = F.linear  # as in ColumnParallelLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_linear(self.tp_enter(x, self.group), self.weight, None)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean token cross-entropy of logits split by vocabulary, without gathering them (Megatron's formulation).

    Forward: a global row maximum (all-reduce MAX), a global sum of exponentials and the target's logit, owned by one
    rank (two all-reduce SUMs). Backward: softmax minus one-hot on this rank's slice; no communication."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.float()
        row_max = logits.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local_target = targets - vocab_start
        owned = (local_target >= 0) & (local_target < logits.shape[-1])
        index = local_target.masked_fill(~owned, 0).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)
        both = torch.stack([sum_exp, target_logit])
        dist.all_reduce(both, group=group)
        sum_exp, target_logit = both[0], both[1]
        loss = (sum_exp.log() - target_logit).mean()
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, owned)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned = ctx.saved_tensors
        grad_logits = softmax
        grad_logits.scatter_add_(-1, index, -owned.unsqueeze(-1).to(grad_logits.dtype))
        grad_logits.mul_(grad / owned.numel())
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Mean cross-entropy of (..., V/tp) logit slices against global target ids (...)."""
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.reshape(-1), vocab_start, group)


# ----------------------------------------------------------------------------------------------------------------
# The plan


def apply_tensor_parallel(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Split ``model`` (a plain GPT with its full initial weights) in place over the tensor-parallel group.

    Every rank must hold the same full weights before the call (the trainer builds the model from one seed), so the
    shards are exactly the single-process weights: a run starts from the same point under any layout."""
    if dims.tp == 1:
        return model
    problems = check_divisible(model.config.n_head, model.blocks[0].mlp.fc_in.out_features,
                               model.config.vocab_size, dims.tp)
    if problems:
        raise ValueError("; ".join(problems))
    def enter_region(module, args):
        return (module.tp_enter(args[0], dims.tp_group),) + tuple(args[1:])

    for block in model.blocks:
        attn = block.attn
        for region in (attn, block.mlp):
            region.tp_enter = copy_to_tp  # sequence parallelism swaps in an all-gather (launcher/parallel/sequence.py)
            region.register_forward_pre_hook(enter_region)
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), dims))
        attn.out_proj = RowParallelLinear(attn.out_proj, dims)
        attn.n_head //= dims.tp  # local heads; the attention function knows their global offset
        block.mlp.fc_in = ColumnParallelLinear(block.mlp.fc_in, dims)
        block.mlp.fc_out = RowParallelLinear(block.mlp.fc_out, dims)
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, dims)
    model.lm_head = VocabParallelHead(model.tok_emb)
    model.loss_fn = functools.partial(vocab_parallel_cross_entropy, vocab_start=model.tok_emb.vocab_start,
                                      group=dims.tp_group)
    return model


def head_range(n_head: int, dims: ParallelDims) -> tuple[int, int]:
    """(first global head of this rank, heads in the model): what the attention kernel needs for global indices."""
    return dims.tp_rank * (n_head // dims.tp), n_head


def gather_full(tensor: torch.Tensor, shard: Optional[Shard], dims: ParallelDims) -> torch.Tensor:
    """The full tensor of this rank's slice ``tensor`` of a parameter split as ``shard`` (None: replicated, returned
    as is). Collective over the tensor-parallel group for split parameters: every rank of it must call."""
    if shard is None or dims.tp == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(dims.tp)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=dims.tp_group)
    return torch.cat(parts, dim=shard.dim)
