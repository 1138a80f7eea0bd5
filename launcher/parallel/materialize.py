"""A model built on the meta device made real, one rank's share at a time.

The trainer builds the plain GPT under ``torch.device("meta")``: shapes and modules, no storage. The layout is applied
to that skeleton (tensor parallelism cuts meta slices, sequence parallelism marks parameters and hooks them), and
:func:`materialize` then gives storage on this rank's device to the parameters this rank holds (the whole
tensor-split model, or under pipeline parallelism its stage's layers) and sets each to its slice of the
single-device model's initial value (``model.gpt.initial_value``, a pure function of the seed and the parameter's
name). So every layout starts from exactly the weights of one process, and no rank ever allocates a parameter it
does not hold. The price is time, not memory: the initial value of a tensor-split parameter is drawn whole on the CPU
(one parameter at a time) and this rank's slice copied out of it.

Parameters keep their identity (``torch.utils.swap_tensors``), so the modules that share one (the tied embedding),
the attributes the layout recorded on them (``tp_shard``, DeepSpeed's ``tensor_model_parallel``) and their gradient
hooks (sequence parallelism's sums) are those of the real parameter afterwards.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from launcher.parallel.dims import ParallelDims
from launcher.parallel.tensor import shard_of
from model.gpt import GPTConfig, initial_value


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The single-device shape of a (possibly tensor-split) parameter."""
    shape = list(param.shape)
    shard = shard_of(param)
    if shard is not None:
        shape[shard.dim] *= shard.parts
    return tuple(shape)


@torch.no_grad()
def materialize(params: Iterable[tuple[str, nn.Parameter]], config: GPTConfig, seed: int, dims: ParallelDims) -> int:
    """Give every meta parameter of ``params`` (single-device name, parameter) storage on ``dims.device`` and its
    initial value (this rank's tensor-parallel slice of it); parameters already real are left alone. Returns the
    number of elements allocated."""
    allocated = 0
    for name, param in params:
        if not param.is_meta:  # real already (e.g. the tied embedding, met a second time)
            continue
        value = initial_value(config, name, full_shape(param), seed)
        shard = shard_of(param)
        if shard is not None:
            value = shard.slice(value, dims.tp_rank)
        real = nn.Parameter(torch.empty(param.shape, device=dims.device), requires_grad=param.requires_grad)
        real.copy_(value)
        real.__dict__.update(param.__dict__)
        hooks = param._backward_hooks
        torch.utils.swap_tensors(param, real)  # `param` is now the real parameter, with its attributes
        if hooks:  # the hooks stayed with the meta tensor's storage: register them on the real one
            param._backward_hooks = hooks
        allocated += param.numel()
    return allocated


def meta_parameters(module: nn.Module) -> list[str]:
    """Names of the parameters of ``module`` that are still on the meta device."""
    return [name for name, p in module.named_parameters() if p.is_meta]
