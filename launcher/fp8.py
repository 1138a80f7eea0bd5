"""FP8 FFN through Transformer Engine, applied to a plain GPT from outside.

The model's MLP matrices (``mlp.fc_in``, ``mlp.fc_out``) are swapped for ``transformer_engine.pytorch.Linear`` with
the same weights; attention projections stay in BF16, as in the industrial setting the paper studies. FP8 is then
switched on for the forward pass by :func:`fp8_context`, which the trainer enters inside its BF16 autocast.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from launcher.config import PrecisionConfig


class FP8Unavailable(RuntimeError):
    """FP8 was asked for where Transformer Engine cannot run; the message says what to change."""


def _te():
    try:
        import transformer_engine.pytorch as te
    except Exception as err:  # ImportError, or OSError when libcuda is missing
        raise FP8Unavailable(f"precision.fp8_ffn=true needs Transformer Engine on a CUDA GPU ({type(err).__name__}: "
                             f"{err}); install the 'gpu' extra on a GPU machine or set precision.fp8_ffn=false") from None
    return te


def make_recipe(precision: PrecisionConfig):
    from transformer_engine.common import recipe

    if precision.fp8_recipe == "current":
        return recipe.Float8CurrentScaling()
    # HYBRID: E4M3 forward (activations, weights), E5M2 backward (gradients), the usual training split.
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def apply_fp8_ffn(model: nn.Module, device: torch.device) -> int:
    """Replace every ``mlp.fc_in``/``mlp.fc_out`` by a TE Linear holding the same parameters; returns the count."""
    if device.type != "cuda":
        raise FP8Unavailable("precision.fp8_ffn=true needs a CUDA GPU; set precision.fp8_ffn=false on CPU")
    te = _te()
    swapped = 0
    for block in model.blocks:
        for name in ("fc_in", "fc_out"):
            old: nn.Linear = getattr(block.mlp, name)
            if old.in_features % 16 or old.out_features % 16:
                raise FP8Unavailable(f"FP8 GEMMs need dimensions divisible by 16; {name} is "
                                     f"{old.in_features}x{old.out_features}: change model.d_model")
            new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                            params_dtype=old.weight.dtype, device=device)
            with torch.no_grad():
                new.weight.copy_(old.weight)
                if old.bias is not None:
                    new.bias.copy_(old.bias)
            setattr(block.mlp, name, new)
            swapped += 1
    return swapped


def fp8_context(precision: PrecisionConfig, group: Optional[object] = None):
    """Context manager enabling FP8 for TE modules (a no-op when fp8_ffn is off). ``group`` reduces amax across
    data-parallel ranks so every rank uses the same scales."""
    if not precision.fp8_ffn:
        return contextlib.nullcontext()
    te = _te()
    recipe = make_recipe(precision)
    if hasattr(te, "autocast"):  # TE >= 2.x: fp8_autocast is deprecated
        return te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
