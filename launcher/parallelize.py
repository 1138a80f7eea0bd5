"""Everything a layout does to the plain model, in one place and in one fixed order.

``parallelize(model, config, dims)`` takes the plain single-device GPT built on the meta device (shapes, no storage)
and returns this rank's part of it, with storage and initial weights, ready for an engine to wrap
(launcher/parallel/build.py)::

    1. tensor parallelism          split attention heads, FFN and vocabulary over the tensor-parallel group
                                   (then sequence parallelism, parallel.sequence_parallel, and the overlapped
                                   input-gradient reduction, parallel.tp_async_grad_reduce)
    2. attention binding           the configured attention, told the global index of this rank's first head
    3. materialisation             the whole model, or under pipeline parallelism this rank's stage, gets storage on
                                   its device and its initial weights (launcher/parallel/materialize.py); under
                                   ZeRO-3 one block at a time, each partitioned over data parallel (after its FP8
                                   fusion) before the next is materialised
    4. FP8                         each block's ln2 + MLP become Transformer Engine's fused FP8 FFN
    5. activation checkpointing    each block is wrapped for recomputation in the backward
    6. ZeRO-3 switches             the attention calls its q, k, v projections as modules

Why this order: the tensor split works on the plain modules and must come first (on the meta device it cuts
shapes only, so no rank holds a parameter it does not keep); the attention needs the split's head offset; FP8
modules are created directly on the device from real weights, so materialisation comes before them; checkpointing wraps
the finished block (wrapping first would leave the FP8 swap on the wrapper, while the wrapped block kept running
its old modules: issue 20); the ZeRO-3 switch needs the final attention modules. Engines only wrap (DDP, ZeRO, the
pipeline) and never change the model. torchtitan's ``parallelize_llama`` has the same shape.

Under pipeline parallelism, steps 1-2 apply to the whole (meta) model (a stage is cut from the split model's own
modules), step 3 cuts this rank's stage and materialises only it (launcher/parallel/pipeline.py; the other stages'
layers stay on the meta device), and steps 4-6 apply to the stage's blocks only.
"""

from __future__ import annotations

from typing import Union

from torch import nn

from launcher.config import Config
from launcher.fp8 import apply_fp8_ffn
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import partition_zero3
from launcher.parallel.materialize import materialize, meta_parameters
from launcher.parallel.names import named_parameters
from launcher.parallel.pipeline import PipelineStage, build_stage
from launcher.parallel.sequence import apply_async_grad_reduce, apply_sequence_parallel
from launcher.parallel.tensor import apply_tensor_parallel, head_range
from model import GPT, build_attention
from model.gpt import CausalSelfAttention

Part = Union[GPT, PipelineStage]
"""What parallelize returns: the whole model (no pipeline) or this rank's pipeline stage."""


def parallelize(model: GPT, config: Config, dims: ParallelDims) -> Part:
    """Apply the layout of ``config`` to ``model`` in the order of the module docstring; returns this rank's part.
    Every rank must call it (cutting a pipeline stage creates process groups)."""
    apply_tensor_parallel(model, dims)
    # sequence parallelism and the overlapped gradient reduction swap the split regions' entry and exit functions:
    # right after the tensor split they extend, before anything binds to the split modules
    if config.parallel.sequence_parallel:
        apply_sequence_parallel(model, dims)
    if config.parallel.tp_async_grad_reduce and dims.tp > 1:
        apply_async_grad_reduce(model, dims, config.parallel.sequence_parallel)
    bind_attention(model, config, dims)
    part = place(model, config, dims)
    blocks = blocks_of(part)
    if config.precision.fp8_ffn:
        apply_fp8_ffn(blocks.values(), config.precision, dims)
    if config.parallel.activation_checkpointing:
        checkpoint_blocks(part)
    if config.parallel.zero_stage == 3:
        # ZeRO-3 gathers a module's parameters in that module's own forward: the projections must be called as
        # modules, not fused into one product from their weights
        for block in blocks.values():
            for module in block.modules():
                if isinstance(module, CausalSelfAttention):
                    module.fused_qkv = False
    if isinstance(part, PipelineStage):  # after the FP8 swap: TE's parameters under the plain names too
        part.names = {id(p): name for name, p in named_parameters(model)}
    return part


def bind_attention(model: GPT, config: Config, dims: ParallelDims) -> None:
    """The configured attention in every layer, with this rank's first global head (head-dependent numerics)."""
    model.set_attention(_attention(config, dims))


def rebind_attention(blocks: dict[int, nn.Module], config: Config, dims: ParallelDims) -> None:
    """The attention of ``config`` in this rank's ``blocks`` (the engine's, by global layer index) of an already laid
    out model: what monitor.on_warning=switch_fix does mid-run. The same function as at the start builds it."""
    attention_fn = _attention(config, dims)
    for block in blocks.values():
        block.attn.attention_fn = attention_fn  # through an activation-checkpoint wrapper too (it forwards .attn)


def _attention(config: Config, dims: ParallelDims):
    first_head, heads = head_range(config.model.n_head, dims)
    return build_attention(config.attention, dims.device, head_offset=first_head, total_heads=heads)


def place(model: GPT, config: Config, dims: ParallelDims) -> Part:
    """This rank's part, materialised on its device: the model, or under pipeline parallelism its stage (the other
    stages' layers stay on the meta device)."""
    if dims.pp > 1:
        return build_stage(model, config, dims)
    names = named_parameters(model)
    if config.parallel.zero_stage == 3 and dims.distributed:
        # ZeRO-3 partitions each unit right after it is materialised (and its FFN fused to FP8, which needs the whole
        # weights): no rank ever holds more than one block's slice whole
        embeddings = nn.ModuleList([model.tok_emb, model.pos_emb, model.ln_f])
        for unit in [embeddings, *model.blocks]:
            mine = {id(p) for p in unit.parameters()}
            materialize([(n, p) for n, p in names if id(p) in mine], config.model, model.seed, dims)
            if config.precision.fp8_ffn and unit is not embeddings:
                apply_fp8_ffn([unit], config.precision, dims)
            partition_zero3(unit, config, dims)
    else:
        materialize(names, config.model, model.seed, dims)
    left = meta_parameters(model)
    if left:
        raise RuntimeError(f"parameters without storage after materialisation: {left[:3]}")
    return model


def blocks_of(part: Part) -> dict[int, nn.Module]:
    """The part's transformer blocks by global layer index."""
    return part.blocks() if isinstance(part, PipelineStage) else dict(enumerate(part.blocks))


def checkpoint_blocks(part: Part) -> None:
    """Wrap each of the part's blocks for activation checkpointing."""
    if isinstance(part, PipelineStage):
        for layer in part.layers().values():
            layer.block = checkpointed(layer.block)
    else:
        for i, block in enumerate(part.blocks):
            part.blocks[i] = checkpointed(block)


def checkpointed(block: nn.Module) -> nn.Module:
    """``block`` recomputed in the backward instead of keeping its activations (torch's non-reentrant wrapper; the
    wrapper's name is removed from parameter names by launcher/parallel/names.py)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
