"""FP8 FFNs through Transformer Engine, applied to a plain (possibly tensor-split) GPT from outside.

Each block's ``ln2`` and ``mlp`` become one :class:`FP8FeedForward`: TE's fused ``LayerNormMLP`` (LayerNorm, fc1,
tanh-GELU, fc2 in one module, so the GELU output is cast to FP8 inside the fused kernel instead of going through
memory in BF16) holding the same weights. The block keeps its structure, ``x + mlp(ln2(x))``, with ``ln2`` an
identity. Attention projections stay in BF16, as in the industrial setting the paper studies.

Layouts:
- tensor parallel: TE's own column (fc1) and row (fc2) parallel modes over the tensor-parallel group, holding the
  slices :mod:`launcher.parallel.tensor` cut; TE does the MLP's two collectives itself. With sequence parallelism,
  TE's ``sequence_parallel`` mode (all-gather of the LayerNorm output, reduce-scatter of fc2's), and the gradients
  of its replicated parameters summed over the group (launcher/parallel/sequence.py).
- every layout: the module enters ``te.autocast`` around its own call, with the FP8 amax reduction group = the
  tensor x data-parallel ranks of its pipeline stage (``ParallelDims.amax_group``). Owning the context makes FP8
  independent of who calls the forward (the trainer, DeepSpeed's ZeRO engine, DeepSpeed's pipeline schedule, the
  monitors' probe), and the group never spans pipeline stages: a collective over stages that run different
  micro-batches would hang (TransformerEngine#1006, Megatron-LM#912).

Names: the fused module's parameters are reported under the plain model's names (``blocks.3.ln2.weight``,
``blocks.3.mlp.fc_in.weight``, ...; launcher/parallel/names.py), so checkpoints, monitors and layouts see one model.
The plain model's LayerNorms have no bias; TE's LayerNorm always adds one, which then is a constant zero buffer.

Delayed scaling keeps state (per-tensor scales and amax histories). :func:`scaling_state` /
:func:`load_scaling_state` move it in and out of checkpoints as plain tensors; TE's own ``get_extra_state`` pickles
it, and TE refuses to unpickle that without an opt-in to unsafe loading.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from launcher.config import PrecisionConfig
from launcher.parallel.dims import ParallelDims
from launcher.parallel.sequence import is_sequence_parallel, sum_gradient_over_tp
from launcher.parallel.tensor import mark_sharded, shard_of

RECIPES = ("delayed", "current", "block")

# checkpoint key -> (TE's fp8_meta entry, attribute of its recipe state)
_SCALING_TENSORS = {"scale_fwd": ("scaling_fwd", "scale"), "amax_history_fwd": ("scaling_fwd", "amax_history"),
                    "scale_bwd": ("scaling_bwd", "scale"), "amax_history_bwd": ("scaling_bwd", "amax_history")}


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
    """TE's scaling recipe: delayed (per-tensor scales from an amax history; the default), current (per-tensor
    scales from the tensor itself) or block (Hopper 1x128 / 128x128 block scales, as in DeepSeek-V3)."""
    from transformer_engine.common import recipe

    if precision.fp8_recipe == "current":
        return recipe.Float8CurrentScaling()
    if precision.fp8_recipe == "block":
        return recipe.Float8BlockScaling()
    # HYBRID: E4M3 forward (activations, weights), E5M2 backward (gradients), the usual training split.
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


class _WeightView:
    """Stands in for ``mlp.fc_in`` / ``mlp.fc_out`` where code reads a linear layer's ``weight`` (the monitors)."""

    def __init__(self, weight: nn.Parameter):
        self.weight = weight


class FP8FeedForward(nn.Module):
    """``ln2`` + MLP of one block as TE's fused LayerNormMLP, run in FP8 under its own ``te.autocast``."""

    def __init__(self, ln: nn.LayerNorm, mlp: nn.Module, precision: PrecisionConfig, dims: ParallelDims):
        super().__init__()
        te = _te()
        fc_in, fc_out = mlp.fc_in, mlp.fc_out
        hidden = fc_in.out_features * dims.tp  # TE takes the full width and splits it itself
        # sequence parallelism (launcher/parallel/sequence.py) marked the block's LayerNorm: TE's own mode then
        # all-gathers the LayerNorm output and reduce-scatters fc2's
        sequence_parallel = is_sequence_parallel(ln.weight)
        self.fused = te.LayerNormMLP(  # 'mlp.fused': the name launcher/parallel/names.py maps back
            fc_in.in_features, hidden, eps=ln.eps, bias=fc_in.bias is not None, normalization="LayerNorm",
            activation="gelu",  # TE's GELU is the tanh approximation, as in model.gpt.MLP
            set_parallel_mode=dims.tp > 1, tp_group=dims.tp_group if dims.tp > 1 else None, tp_size=dims.tp,
            sequence_parallel=sequence_parallel,
            params_dtype=torch.float32, device=dims.device)
        fused = self.fused
        with torch.no_grad():
            fused.layer_norm_weight.copy_(ln.weight)
            fused.fc1_weight.copy_(fc_in.weight)  # this rank's slices, as cut by tensor parallelism
            fused.fc2_weight.copy_(fc_out.weight)
            if fc_in.bias is not None:
                fused.fc1_bias.copy_(fc_in.bias)
                fused.fc2_bias.copy_(fc_out.bias)
            if ln.bias is not None:
                fused.layer_norm_bias.copy_(ln.bias)
            else:  # the plain model's LayerNorm has no shift: TE's becomes a constant zero, not a parameter
                del fused._parameters["layer_norm_bias"]
                fused.register_buffer("layer_norm_bias", torch.zeros(ln.normalized_shape, device=dims.device),
                                      persistent=False)
        # the tensor-parallel split of each parameter, as launcher.parallel.tensor recorded it on the plain ones
        for plain, te_param in ((fc_in.weight, fused.fc1_weight), (fc_out.weight, fused.fc2_weight),
                                (fc_in.bias, getattr(fused, "fc1_bias", None))):
            if plain is not None and shard_of(plain) is not None:
                mark_sharded(te_param, shard_of(plain))
        if sequence_parallel:  # TE leaves the gradients of its replicated parameters partial, as Megatron expects
            for te_param in (fused.layer_norm_weight, fused._parameters.get("layer_norm_bias"),
                             getattr(fused, "fc2_bias", None)):
                if te_param is not None:
                    sum_gradient_over_tp(te_param, dims.tp_group)
        self.dropout = mlp.dropout
        self.recipe = make_recipe(precision)
        self.amax_group = dims.amax_group if dims.distributed else None
        self.fp8 = True  # False: the ambient precision (BF16 autocast) instead of FP8; see side_pass
        self.fc_in, self.fc_out = _WeightView(fused.fc1_weight), _WeightView(fused.fc2_weight)
        self._autocast = te.autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._autocast(enabled=self.fp8, recipe=self.recipe, amax_reduction_group=self.amax_group):
            y = self.fused(x)
        return self.dropout(y)


def require_gpu(device: torch.device) -> None:
    """Transformer Engine runs on CUDA GPUs only (the CPU tests replace this check along with TE itself)."""
    if device.type != "cuda":
        raise FP8Unavailable("precision.fp8_ffn=true needs a CUDA GPU; set precision.fp8_ffn=false on CPU")


def apply_fp8_ffn(blocks, precision: PrecisionConfig, dims: ParallelDims) -> int:
    """Fuse ``ln2`` + ``mlp`` of each block into an :class:`FP8FeedForward` on ``dims.device`` (in place); returns
    the number of blocks changed. ``blocks``: the model's blocks, or a pipeline stage's."""
    require_gpu(dims.device)
    count = 0
    for block in blocks:
        if isinstance(block.mlp, FP8FeedForward):
            continue
        block.mlp = FP8FeedForward(block.ln2, block.mlp, precision, dims)
        block.ln2 = nn.Identity()
        count += 1
    return count


@contextlib.contextmanager
def side_pass(model: nn.Module):
    """Context for a forward/backward of ``model`` that is not a training step and that not every rank of an amax
    group makes (the monitors' probe): the FFNs run in BF16 instead of FP8. In FP8, such a pass would record
    amaxes and, on leaving TE's autocast, reduce them (and any still pending from an evaluation) with an all-reduce
    that the other ranks never join: a hang. In BF16, TE records nothing, reduces nothing and keeps its scaling
    state as it was."""
    modules = [m for m in model.modules() if isinstance(m, FP8FeedForward)]
    for module in modules:
        module.fp8 = False
    try:
        yield
    finally:
        for module in modules:
            module.fp8 = True


def fp8_modules(blocks: dict[int, nn.Module]) -> dict[str, nn.Module]:
    """{"blocks.{i}.mlp": TE module} of the given blocks (by global layer index) that run in FP8."""
    return {f"blocks.{i}.mlp": b.mlp.fused for i, b in blocks.items() if isinstance(b.mlp, FP8FeedForward)}


def scaling_state(blocks: dict[int, nn.Module]) -> dict[str, dict[str, torch.Tensor]]:
    """Delayed-scaling state (scales and amax histories, on the CPU) of the given blocks' FP8 FFNs; empty for
    stateless recipes and before the first FP8 step. Identical on the ranks of an amax group (reduced there)."""
    state = {}
    for name, module in fp8_modules(blocks).items():
        meta = module.fp8_meta
        if "scaling_fwd" not in meta or not hasattr(meta["scaling_fwd"], "amax_history"):
            continue
        state[name] = {key: getattr(meta[entry], attr).detach().cpu().clone()
                       for key, (entry, attr) in _SCALING_TENSORS.items()}
    return state


def load_scaling_state(blocks: dict[int, nn.Module], state: dict, precision: PrecisionConfig) -> int:
    """Install saved delayed-scaling state into the given blocks' FP8 FFNs before their first step; returns how
    many modules received state. State of another recipe, or of modules not here, is ignored."""
    if precision.fp8_recipe != "delayed":
        return 0
    loaded = 0
    for name, module in fp8_modules(blocks).items():
        saved = state.get(name)
        if saved is None:
            continue
        meta = module.fp8_meta
        meta["recipe"] = make_recipe(precision)
        meta["num_gemms"] = 2  # fc1 and fc2
        module.init_fp8_meta_tensors(meta["recipe"])  # TE's first forward keeps tensors that already exist
        with torch.no_grad():
            for key, (entry, attr) in _SCALING_TENSORS.items():
                getattr(meta[entry], attr).copy_(saved[key])
        loaded += 1
    return loaded
