"""A stand-in for the parts of Transformer Engine that launcher/fp8.py uses, for CPU tests of the FP8 plumbing.

What it models: the module interface (``LayerNormMLP`` with TE's parameter names, its tensor- and sequence-parallel
modes, its ``fp8_meta`` delayed-scaling state), and TE's collectives. Leaving an enabled ``autocast`` with gradients on
all-reduces (MAX) the amaxes recorded inside it over ``amax_reduction_group``, and the backward of an FP8 module
does the same for its gradients. A rank that makes such a pass alone waits forever, as with TE, so a layout or a
monitor that breaks the symmetry hangs these tests too. What it does not model: FP8 arithmetic (the math is the
plain FP32/BF16 one) and TE's buffering of amaxes across autocast regions.

``install()`` registers it as ``transformer_engine`` in ``sys.modules``.
"""

from __future__ import annotations

import enum
import sys
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from launcher.parallel.sequence import gather_from_sequence, reduce_scatter_to_sequence
from launcher.parallel.tensor import copy_to_tp, reduce_from_tp

HISTORY = 16


class Format(enum.Enum):
    HYBRID = "hybrid"


@dataclass
class DelayedScaling:
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = HISTORY
    amax_compute_algo: str = "max"


class Float8CurrentScaling:
    pass


class Float8BlockScaling:
    pass


class _State:
    """TE's global FP8 state, reduced to what the fake needs: the current region's settings and its amaxes."""
    enabled = False
    recipe = None
    group = None
    pending: list = []


def _reduce_max(t: torch.Tensor, group) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


class autocast:  # noqa: N801 (TE's name)
    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
        self.enabled, self.recipe, self.group = enabled, recipe, amax_reduction_group

    def __enter__(self):
        self.saved = (_State.enabled, _State.recipe, _State.group, _State.pending)
        _State.enabled, _State.recipe, _State.group, _State.pending = self.enabled, self.recipe, self.group, []
        return self

    def __exit__(self, *exc):
        pending = _State.pending
        _State.enabled, _State.recipe, _State.group, _State.pending = self.saved
        if self.enabled and torch.is_grad_enabled() and pending:  # TE: reduce amaxes, update scales
            for meta, amax in pending:
                _reduce_max(amax, self.group)
                if "scaling_fwd" in meta:
                    _roll(meta["scaling_fwd"], amax)


class _ScalingState:
    def __init__(self):
        self.amax_history = torch.zeros(HISTORY, 3)
        self.scale = torch.ones(3)


def _roll(state: _ScalingState, amax: torch.Tensor) -> None:
    state.amax_history = torch.roll(state.amax_history, 1, 0)
    state.amax_history[0] = amax
    state.scale = 448.0 / state.amax_history.amax(0).clamp(min=1e-12)


class _BackwardAmax(torch.autograd.Function):
    """Identity; in the backward, the gradient's amax is reduced over the forward's group (TE's backward reduction)."""

    @staticmethod
    def forward(ctx, x, meta, group):
        ctx.meta, ctx.group = meta, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        amax = grad.detach().abs().amax().float().reshape(1).repeat(3)
        _reduce_max(amax, ctx.group)
        if "scaling_bwd" in ctx.meta:
            _roll(ctx.meta["scaling_bwd"], amax)
        return grad, None, None


class LayerNormMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", set_parallel_mode=False, tp_group=None, tp_size=1, params_dtype=torch.float32,
                 device="cpu", sequence_parallel=False, **_):
        super().__init__()
        local = ffn_hidden_size // tp_size
        self.eps, self.tp_group, self.tp_size, self.sequence_parallel = eps, tp_group, tp_size, sequence_parallel
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=params_dtype))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=params_dtype))
        self.fc1_weight = nn.Parameter(torch.empty(local, hidden_size, device=device, dtype=params_dtype))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, local, device=device, dtype=params_dtype))
        if bias:
            self.fc1_bias = nn.Parameter(torch.zeros(local, device=device, dtype=params_dtype))
            self.fc2_bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=params_dtype))
        else:
            self.fc1_bias = self.fc2_bias = None
        self.fp8_meta: dict = {}

    def init_fp8_meta_tensors(self, recipe) -> None:
        if isinstance(recipe, DelayedScaling) and "scaling_fwd" not in self.fp8_meta:
            self.fp8_meta["scaling_fwd"], self.fp8_meta["scaling_bwd"] = _ScalingState(), _ScalingState()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = _State.enabled
        if fp8:
            self.fp8_meta["recipe"] = _State.recipe
            self.init_fp8_meta_tensors(_State.recipe)
            _State.pending.append((self.fp8_meta, x.detach().abs().amax().float().reshape(1).repeat(3)))
            x = _BackwardAmax.apply(x, self.fp8_meta, _State.group)
        h = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)
        if self.sequence_parallel:  # TE gathers the tokens of its 2-D view along their first dimension
            h = gather_from_sequence(h.flatten(0, -2), self.tp_group, dim=0)
        elif self.tp_size > 1:
            h = copy_to_tp(h, self.tp_group)
        h = F.gelu(F.linear(h, self.fc1_weight, self.fc1_bias), approximate="tanh")
        y = F.linear(h, self.fc2_weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.tp_group, dim=0).view(*x.shape[:-1], -1)
        elif self.tp_size > 1:
            y = reduce_from_tp(y, self.tp_group)
        return y if self.fc2_bias is None else y + self.fc2_bias


def install() -> None:
    """Register the fake as ``transformer_engine`` (with ``.pytorch`` and ``.common.recipe``)."""
    root = types.ModuleType("transformer_engine")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pytorch.LayerNormMLP, pytorch.autocast = LayerNormMLP, autocast
    recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling, recipe.Format = (
        DelayedScaling, Float8CurrentScaling, Float8BlockScaling, Format)
    root.pytorch, root.common, common.recipe = pytorch, common, recipe
    sys.modules.update({"transformer_engine": root, "transformer_engine.pytorch": pytorch,
                        "transformer_engine.common": common, "transformer_engine.common.recipe": recipe})
