"""Pipeline parallelism through DeepSpeed's ``PipelineModule``, built from the single-device GPT's own modules.

The model becomes a sequence of layers, each an existing module of the (tensor-split) GPT, so there is no second
model definition::

    [token embedding] [positions + dropout] [block 0] ... [block L-1] [final LayerNorm] [output layer]
     tied "embed" ----------------------------------------------------------------------- tied "embed"

The token embedding and the output layer share one weight (GPT-2's tied embeddings): both ends are
``TiedLayerSpec("embed")``; DeepSpeed keeps a copy on the first and on the last stage, starts them equal, sums their
gradients, and counts the weight once in the gradient norm. Layers are partitioned over the stages by parameter
count. The recipe's gradient accumulation becomes the pipeline's micro-batches, run with DeepSpeed's 1F1B schedule
(``train_batch``).

Row keys (runs whose attention draws random bits, ``AttentionConfig.needs_noise_keys``): the first stage gets
(token ids, row keys), and every layer up to the last block passes (hidden states, row keys) on, so that the keys
cross stage boundaries with the activations (DeepSpeed sends every tensor of a tuple, and gradients of the floating
ones only). Each block layer (a :class:`PipelineBlock`) passes the keys on; ``drop_row_keys`` after the last block
hands the final LayerNorm the hidden states alone. Evaluation sends key 0 for every row (what the single-device model
does without keys). Every other run passes the hidden states alone.

:func:`build_stage` makes this rank's stage (launcher/parallelize.py calls it as its materialisation step, then
applies FP8 and activation checkpointing to the stage's blocks); :class:`PipelineEngine` only wraps it. The model
arrives on the meta device: the stage's layers are found with DeepSpeed's own partitioning function before the
``PipelineModule`` exists (it moves its layers to the device and broadcasts the tied weight when it is built), and
only they are materialised; the other stages' layers never get storage on this rank.

Sequence parallelism (launcher/parallel/sequence.py) needs nothing here but two settings: the positions layer ends
with the GPT's ``drop``, which then splits the sequence, so stage boundaries carry each tensor-parallel rank's own
positions, (batch, T / tp, d); DeepSpeed must therefore send them whole instead of 1/tp per rank, and the monitors'
probe pass sends that shape.

Data parallelism under the pipeline always goes through DeepSpeed's ZeRO-1 optimizer (``zero_stage`` 0 runs as 1:
the same numerics, optimizer state sharded); ZeRO-2 and -3 are refused by validation because DeepSpeed does not
support them with a pipeline. The guard's veto works as in the ZeRO engine (inside DeepSpeed's optimizer step, once
the global gradient norm is known); the loss it judges is the last stage's mean over the micro-batches and
data-parallel ranks, sent to every rank before anything is updated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from launcher.config import Config
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import ZeroEngine, deepspeed_config, import_deepspeed
from launcher.parallel.materialize import materialize
from launcher.parallel.names import named_parameters

FIRST_BLOCK = 2  # pipeline layers 0 and 1 are the token embedding and the positions; the blocks follow


class TokenEmbedding(nn.Module):
    """The token embedding and the output layer that shares its weight; the first stage embeds token ids, the last
    stage projects hidden states to (its slice of) the vocabulary."""

    def __init__(self, embedding: nn.Module, head: nn.Module):
        super().__init__()
        self.embedding, self.head = embedding, head

    def forward(self, inputs):
        if isinstance(inputs, tuple):  # (ids, row keys): the keys travel on with the hidden states
            ids, row_keys = inputs
            return self.embedding(ids), row_keys
        return self.embedding(inputs)


def project_to_vocabulary(tied: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return tied.head(x)


class AddPositions(nn.Module):
    """Learned position embeddings added to the token embeddings, then dropout (as in GPT.forward)."""

    def __init__(self, pos_emb: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.pos_emb, self.drop = pos_emb, drop

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            x, row_keys = inputs
            return self._add(x), row_keys
        return self._add(inputs)

    def _add(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x + self.pos_emb(torch.arange(x.shape[1], device=x.device)))


class PipelineBlock(nn.Module):
    """A block as a pipeline layer. Its ``block`` may be replaced once the stage is built (activation checkpointing
    wraps it after the FP8 swap, launcher/parallelize.py), which a layer registered with DeepSpeed cannot be.

    Keyed runs: (x, row keys) -> (block(x, row keys), row keys); the keys are an argument of the block, so a
    checkpointed block recomputes with them. A plain tensor (every other run, and the monitors' probe pass) runs the
    block without keys."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            x, row_keys = inputs
            return self.block(x, row_keys), row_keys
        return self.block(inputs)


def drop_row_keys(inputs):
    """After the last block of a keyed run: the hidden states without the keys."""
    return inputs[0] if isinstance(inputs, tuple) else inputs


def stage_batch(batch: tuple[torch.Tensor, ...]) -> tuple:
    """A trainer micro-batch as DeepSpeed's pipeline takes it: (inputs, labels), inputs (ids, row keys) if keyed."""
    x, y, *row_keys = batch
    return ((x, *row_keys), y) if row_keys else (x, y)


class MicroBatchLosses:
    """The model's loss as the pipeline's ``loss_fn`` (last stage), keeping each micro-batch's value for the step's
    loss."""

    def __init__(self, model_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.model_loss = model_loss
        self.values: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.model_loss(logits, targets)
        self.values.append(loss.detach())
        return loss


class PipelineStage:
    """This rank's stage of the GPT: a DeepSpeed ``PipelineModule`` holding its share of the layers (see the module
    docstring), on this rank's device. Built by :func:`build_stage`; launcher/parallelize.py then applies FP8 and
    activation checkpointing to its blocks and records the plain model's parameter names (``names``)."""

    def __init__(self, module: nn.Module, losses: MicroBatchLosses):
        self.module, self.losses = module, losses
        self.names: dict[int, str] = {}
        """id(parameter) -> the single-device model's name of it."""

    def layers(self) -> dict[int, PipelineBlock]:
        """This stage's block layers by global layer index."""
        first = self.module._local_start  # index of this stage's first layer in the full layer list
        return {i - FIRST_BLOCK: layer for i, layer in enumerate(self.module.forward_funcs, start=first)
                if isinstance(layer, PipelineBlock)}

    def blocks(self) -> dict[int, nn.Module]:
        """This stage's transformer blocks (activation-checkpoint wrapped or not) by global layer index."""
        return {i: layer.block for i, layer in self.layers().items()}

    def functions(self) -> list[Callable]:
        """This stage's layers in order, as the pipeline calls them."""
        return list(self.module.forward_funcs)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This stage's parameters under the single-device model's names."""
        return [(parameter_name(self.names, p), p) for p in self.module.parameters()]


def _layer_modules(layer) -> list[nn.Module]:
    """The modules a pipeline layer (a module, a tied layer's spec or a function) holds parameters in."""
    from deepspeed.pipe import LayerSpec

    if isinstance(layer, LayerSpec):
        return [arg for arg in layer.module_args if isinstance(arg, nn.Module)]
    return [layer] if isinstance(layer, nn.Module) else []


def stage_layers(layers: list, stages: int) -> list[int]:
    """The first layer of each stage and the end, as DeepSpeed's ``partition_method="parameters"`` computes them
    (``PipelineModule._count_layer_params``: trainable elements per layer, then ``partition_balanced``); on the meta
    device, before the stages exist."""
    from deepspeed.runtime import utils as ds_utils

    counts = [sum(p.numel() for p in layer_parameters(layer) if p.requires_grad) for layer in layers]
    return ds_utils.partition_balanced(weights=counts, num_parts=stages)


def pipeline_layers(gpt: nn.Module, config: Config) -> list:
    """The GPT as DeepSpeed's pipeline layers (the module docstring's list)."""
    from deepspeed.pipe import TiedLayerSpec

    blocks = [PipelineBlock(b) for b in gpt.blocks]
    if config.attention.needs_noise_keys:
        blocks.append(drop_row_keys)
    return [TiedLayerSpec("embed", TokenEmbedding, gpt.tok_emb, gpt.lm_head, tied_weight_attr="embedding.weight"),
            AddPositions(gpt.pos_emb, gpt.drop), *blocks, gpt.ln_f,
            TiedLayerSpec("embed", TokenEmbedding, gpt.tok_emb, gpt.lm_head, forward_fn=project_to_vocabulary,
                          tied_weight_attr="embedding.weight")]


def layer_parameters(layer) -> list[nn.Parameter]:
    """The parameters a pipeline layer holds (a tied one once)."""
    return list({id(p): p for m in _layer_modules(layer) for p in m.parameters()}.values())


def build_stage(gpt: nn.Module, config: Config, dims: ParallelDims) -> PipelineStage:
    """This rank's stage of ``gpt`` (tensor-split, attention bound, on the meta device), materialised on
    ``dims.device``; the other stages' layers stay on the meta device. Every rank of the layout must call it."""
    deepspeed = import_deepspeed()
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    # PipelineModule creates its communicators through deepspeed.comm, which wraps our process group
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    layers = pipeline_layers(gpt, config)
    parts = stage_layers(layers, dims.pp)
    mine = {id(p) for layer in layers[parts[dims.pp_rank]:parts[dims.pp_rank + 1]] for p in layer_parameters(layer)}
    materialize([(n, p) for n, p in named_parameters(gpt) if id(p) in mine], config.model, gpt.seed, dims)
    losses = MicroBatchLosses(gpt.loss_fn)
    topology = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
    module = PipelineModule(layers, topology=topology, loss_fn=losses, partition_method="parameters")
    if list(module.parts) != list(parts):  # DeepSpeed partitioned otherwise than stage_layers: a version change
        raise RuntimeError(f"DeepSpeed cut the stages at {module.parts}, the materialised layers were {parts}")
    return PipelineStage(module.to(dims.device), losses)


def parameter_name(names: dict[int, str], param: nn.Parameter) -> str:
    name = names.get(id(param))
    if name is None:
        raise RuntimeError("a pipeline parameter does not belong to the model it was built from")
    return name


class PipelineEngine(ZeroEngine):
    """This rank's pipeline stage of the GPT, trained by DeepSpeed's pipeline engine (see the module docstring)."""

    zero_stage = 1

    def __init__(self, stage: PipelineStage, config: Config, dims: ParallelDims, run_dir: Optional[Path] = None):
        self.stage, self.dims, self.config = stage, dims, config
        self.model = stage.module
        self.keyed = config.attention.needs_noise_keys
        self.model_loss = stage.losses.model_loss
        # the pipeline module brings its own topology as DeepSpeed's mpu
        ds_config = deepspeed_config(config, dims, zero_stage=self.zero_stage)
        if config.parallel.sequence_parallel:
            # DeepSpeed sends 1/tp of a stage's output from each tensor-parallel rank and all-gathers it on the next
            # stage, which assumes the ranks hold the same activations; under sequence parallelism each holds its
            # own positions, and each sends them whole
            ds_config["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
        self._start_deepspeed(ds_config, run_dir, mpu=None)
        self.is_last_stage = dims.pp_rank == dims.pp - 1

    def describe(self) -> str:
        return f"DeepSpeed pipeline ({self.dims.pp} stages, 1F1B) with ZeRO-1"

    def _moments_saved_elsewhere(self) -> set[int]:
        # the tied embedding lives on the first stage (layer 0) and is copied to the last one
        return {id(p) for p in self.model.tied_modules.parameters()} if self.dims.pp_rank > 0 else set()

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.stage.named_parameters()

    def blocks(self) -> dict[int, nn.Module]:
        """This stage's transformer blocks by global layer index."""
        return self.stage.blocks()

    def stage_functions(self) -> list[Callable]:
        """This stage's layers in order (the monitors' probe pass runs them itself, launcher/monitors/capture.py)."""
        return self.stage.functions()

    def _stage_loss(self) -> float:
        """The step's loss on every rank: the last stage's mean over its micro-batches, averaged over data parallel
        and sent over the pipeline (a collective over the pipeline and data-parallel groups)."""
        dims = self.dims
        loss = torch.zeros((), device=dims.device)
        if self.is_last_stage:
            loss = torch.stack(self.stage.losses.values).float().mean()
            if dims.dp > 1:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dims.dp_group)
        if dims.pp > 1:
            last = dist.get_global_rank(dims.pp_group, dims.pp - 1)
            dist.broadcast(loss, src=last, group=dims.pp_group)
        return loss.item()

    def train_step(self, micro_batches, autocast, lr, veto):
        # DeepSpeed's engine enters the run's autocast itself (its torch_autocast section); FP8 FFNs enter their own.
        self.stage.losses.values.clear()
        loss: dict[str, float] = {}

        def judge(grad_norm: float) -> Optional[str]:  # the loss exists only now, inside the optimizer step
            loss["value"] = self._stage_loss()
            return veto(loss["value"], grad_norm)

        batches = [stage_batch(b) for b in micro_batches]
        norm, problem = self._vetoed_step(lr, judge, lambda: self.ds.train_batch(data_iter=iter(batches)))
        return loss["value"], norm, problem

    @torch.no_grad()
    def eval_loss(self, batches, autocast):
        if not batches:
            return 0.0, 0
        count = sum(len(x) for x, _ in batches)
        if self.keyed:  # the stages expect the keyed structure; evaluation uses key 0 for every row
            batches = [((x, torch.zeros(len(x), dtype=torch.int64, device=x.device)), y) for x, y in batches]
        mean = self.ds.eval_batch(iter(batches), num_micro_batches=len(batches), bcast_loss=True)
        return float(mean) * count, count
