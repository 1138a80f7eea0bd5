"""Capture per layer what attention sees on the monitors' fixed probe batch: one forward (and, for the delta-bias
monitor, one gradient) pass that records the attention input X (q_proj's input, i.e. ln1's output), q, k, v, the
attention output O and the gradient dO.

The pass runs without row keys: attention that draws random bits uses row key 0 for every probe row (a fixed probe
key, the same at every call; see model.attention.noise_keys and delta_bias.py).

The pass never touches parameter ``.grad``: dO comes from ``torch.autograd.grad`` with respect to the captured
outputs, which computes only what those gradients need. The model's train/eval mode, its attention hooks and the
forward hooks installed here are restored/removed whatever happens.

``capture_model`` runs a whole model; ``capture_stage`` runs one pipeline stage: activations go to the next stage
and gradients come back from it, so that every stage captures its own layers on the same probe batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class LayerCapture:
    x: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    d_out: Optional[torch.Tensor] = None


@dataclass
class Capture:
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    loss: float = float("nan")


@contextlib.contextmanager
def capturing(module: nn.Module, layers: dict[int, nn.Module], result: Capture):
    """Within the context, the forward of ``layers`` (global index -> block) fills ``result.layers``; ``module`` (the
    model or stage holding them) is in eval mode. Everything is restored on exit."""
    handles, old_hooks = [], []
    was_training = module.training

    def capture_attention(layer, q, k, v, o):
        cap = result.layers[layer]
        cap.q, cap.k, cap.v, cap.o = q, k, v, o
        return o

    def input_hook(layer):
        def hook(_module, args):
            result.layers[layer].x = args[0]
        return hook

    result.layers.update({i: LayerCapture() for i in layers})
    try:
        module.eval()
        for i, block in layers.items():
            old_hooks.append((block, block.attn.attention_hook))
            block.attn.attention_hook = capture_attention
            handles.append(block.attn.register_forward_pre_hook(input_hook(i)))  # x: the q/k/v projections' input
        yield result
    finally:
        for h in handles:
            h.remove()
        for block, old in old_hooks:
            block.attn.attention_hook = old
        module.train(was_training)


def _detach_captures(result: Capture) -> None:
    for cap in result.layers.values():
        for name in ("x", "q", "k", "v", "o"):
            t = getattr(cap, name)
            setattr(cap, name, None if t is None else t.detach())


def _attention_outputs(result: Capture, grad_layers: list[int]) -> list[torch.Tensor]:
    outs = [result.layers[i].o for i in grad_layers]
    if not all(o is not None and o.requires_grad for o in outs):
        raise RuntimeError("delta-bias monitor: the attention output does not require grad; the probe needs the "
                           "model's parameters to require grad")
    return outs


def capture_model(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                  autocast: Callable[[], contextlib.AbstractContextManager], grad_layers: list[int],
                  layers: Optional[dict[int, nn.Module]] = None) -> Capture:
    """Forward the probe batch in eval mode under the run's autocast; gradients dO only for ``grad_layers``.

    dO is the gradient of the *summed* token cross-entropy (the model's mean loss times the token count), so its
    scale does not shrink with the probe batch size."""
    inputs, targets = batch
    result = Capture()
    with capturing(model, layers if layers is not None else dict(enumerate(model.blocks)), result):
        with (torch.enable_grad() if grad_layers else torch.no_grad()):
            with autocast():
                _, loss = model(inputs, targets)
            if grad_layers:
                grads = torch.autograd.grad(loss * targets.numel(), _attention_outputs(result, grad_layers))
                for i, g in zip(grad_layers, grads):
                    result.layers[i].d_out = g
        result.loss = float(loss.detach())
        _detach_captures(result)
    return result


def capture_stage(stage: nn.Module, functions: list[Callable], loss_fn: Callable, layers: dict[int, nn.Module],
                  batch: tuple[torch.Tensor, torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager],
                  grad_layers: list[int], backward: bool, pp_rank: int, pp: int, pp_group,
                  hidden: tuple[int, ...], device: torch.device) -> Capture:
    """The probe pass of one pipeline stage (``functions``: its layers in order; ``layers``: its blocks by global
    index). Stage 0 embeds the probe inputs, later stages receive the previous stage's activations (FP32, shape
    ``hidden``), the last computes the loss. With ``backward`` (any stage needs dO), the gradient travels back
    stage by stage; every stage of the pipeline group must call this together."""
    inputs, targets = batch
    first, last = pp_rank == 0, pp_rank == pp - 1
    result = Capture()
    with capturing(stage, layers, result), torch.enable_grad():
        x_in = inputs
        if not first:
            x_in = torch.empty(hidden, device=device)
            dist.recv(x_in, src=dist.get_global_rank(pp_group, pp_rank - 1), group=pp_group)
            x_in.requires_grad_(backward)
        with autocast():
            x = x_in
            for f in functions:
                x = f(x)
            loss = loss_fn(x, targets) if last else None
        if not last:
            dist.send(x.detach().float().contiguous(), dst=dist.get_global_rank(pp_group, pp_rank + 1), group=pp_group)
        if backward:
            wrt = _attention_outputs(result, grad_layers) + ([] if first else [x_in])
            if last:
                grads = torch.autograd.grad(loss * targets.numel(), wrt) if wrt else []
            else:
                grad_x = torch.empty(x.shape, device=device)
                dist.recv(grad_x, src=dist.get_global_rank(pp_group, pp_rank + 1), group=pp_group)
                grads = torch.autograd.grad(x, wrt, grad_outputs=grad_x.to(x.dtype)) if wrt else []
            for i, g in zip(grad_layers, grads):
                result.layers[i].d_out = g
            if not first:
                dist.send(grads[-1].float().contiguous(), dst=dist.get_global_rank(pp_group, pp_rank - 1),
                          group=pp_group)
        if last:
            result.loss = float(loss.detach())
        _detach_captures(result)
    return result
