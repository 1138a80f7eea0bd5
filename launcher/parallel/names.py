"""Parameter names of the single-device model, whatever has been applied to it.

Checkpoints, monitors and layouts name every parameter as the plain GPT does (``blocks.3.mlp.fc_in.weight``), so
that one model is seen under any layout. Two transformations rename parameters, and :func:`canonical_name` undoes
both: torch's activation-checkpoint wrapper inserts ``_checkpoint_wrapped_module.``, and the FP8 FFN (launcher/fp8.py)
holds ``ln2`` + ``mlp`` as Transformer Engine's fused ``LayerNormMLP`` under ``mlp.fused`` with TE's names.
"""

from __future__ import annotations

from torch import nn

CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # inserted by torch's activation-checkpoint wrapper
FUSED_FFN = "mlp.fused"  # where launcher/fp8.py keeps TE's LayerNormMLP inside a block

# the fused module's parameters -> the plain model's names, relative to a block
_FUSED_NAMES = {"layer_norm_weight": "ln2.weight", "layer_norm_bias": "ln2.bias",
                "fc1_weight": "mlp.fc_in.weight", "fc1_bias": "mlp.fc_in.bias",
                "fc2_weight": "mlp.fc_out.weight", "fc2_bias": "mlp.fc_out.bias"}


def canonical_name(name: str) -> str:
    """The plain model's name of a parameter (checkpoint wrappers removed, fused FP8 FFN parameters under the names of
    the modules they replace); other names are returned unchanged."""
    name = name.replace(CHECKPOINT_PREFIX, "")
    head, sep, tail = name.rpartition(f".{FUSED_FFN}.")
    return f"{head}.{_FUSED_NAMES[tail]}" if sep else name


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``model``'s parameters under the plain model's names."""
    return [(canonical_name(n), p) for n, p in model.named_parameters()]
