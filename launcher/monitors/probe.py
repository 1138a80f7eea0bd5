"""One forward (and, for the delta-bias monitor, one gradient) pass of the fixed probe batch, capturing per layer
the attention input X (q_proj's input, i.e. ln1's output), q, k, v, the attention output O and the gradient dO.

The pass never touches parameter ``.grad``: dO comes from ``torch.autograd.grad`` with respect to the captured
outputs, which computes only what those gradients need. The model's train/eval mode, its attention probes and the
hooks installed here are restored/removed whatever happens.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass
class LayerCapture:
    x: Optional[torch.Tensor] = None
    q: Optional[torch.Tensor] = None
    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    d_out: Optional[torch.Tensor] = None


@dataclass
class ProbeResult:
    layers: dict[int, LayerCapture] = field(default_factory=dict)
    loss: float = float("nan")


def run_probe(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
              autocast: Callable[[], contextlib.AbstractContextManager], grad_layers: list[int]) -> ProbeResult:
    """Forward the probe batch in eval mode under the run's autocast; gradients dO only for ``grad_layers``.

    dO is the gradient of the *summed* token cross-entropy (the model's mean loss times the token count), so its
    scale does not shrink with the probe batch size."""
    inputs, targets = batch
    result = ProbeResult({i: LayerCapture() for i in range(len(model.blocks))})
    handles, old_probes = [], []
    was_training = model.training

    def attention_probe(layer, q, k, v, o):
        cap = result.layers[layer]
        cap.q, cap.k, cap.v, cap.o = q, k, v, o
        return o

    def input_hook(layer):
        def hook(_module, args):
            result.layers[layer].x = args[0]
        return hook

    try:
        model.eval()
        for i, block in enumerate(model.blocks):
            old_probes.append(block.attn.probe)
            block.attn.probe = attention_probe
            handles.append(block.attn.q_proj.register_forward_pre_hook(input_hook(i)))
        with (torch.enable_grad() if grad_layers else torch.no_grad()):
            with autocast():
                _, loss = model(inputs, targets)
            if grad_layers:
                outs = [result.layers[i].o for i in grad_layers]
                if not all(o is not None and o.requires_grad for o in outs):
                    raise RuntimeError("delta-bias monitor: the attention output does not require grad; the probe "
                                       "needs the model's parameters to require grad")
                grads = torch.autograd.grad(loss * targets.numel(), outs)
                for i, g in zip(grad_layers, grads):
                    result.layers[i].d_out = g
        result.loss = float(loss.detach())
        for cap in result.layers.values():
            for name in ("x", "q", "k", "v", "o"):
                t = getattr(cap, name)
                setattr(cap, name, None if t is None else t.detach())
    finally:
        for h in handles:
            h.remove()
        for block, old in zip(model.blocks, old_probes):
            block.attn.probe = old
        model.train(was_training)
    return result
