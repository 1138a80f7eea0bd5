"""Memory plan of a recipe under its layout, per rank, before any process starts:

    python -m launcher.plan RECIPE [section.field=value ...] [--world N] [--gpu-gib 79.6]

The model is built on the meta device and split as the run would split it (launcher/parallel/tensor.py's tensor
parallelism, DeepSpeed's own partition of the pipeline stages), for any world size, in one process and without a
process group; ``--world`` is the process count (default: tensor x pipeline parallel, i.e. one data-parallel rank).
For the first rank of every pipeline stage it prints, in GiB:

- parameters (FP32 master weights; under ZeRO-3 this rank's partition), gradients (FP32; partitioned under ZeRO-2/3),
  optimizer state (Adam's two FP32 moments, and DeepSpeed's FP32 master copy of the partition, sharded over data
  parallel under ZeRO), communication buffers (DDP's gradient buckets, ZeRO's reduce bucket, ZeRO-3's gathered
  blocks and prefetch bucket);
- activations per micro-batch, with and without activation checkpointing, times the micro-batches a stage holds at
  once (1F1B: stage s of p holds min(p - s, accumulation steps)); they include the weight copies each micro-batch
  keeps for its backward (BF16 casts under autocast, FP8 casts in the FP8 FFNs, the concatenated q/k/v weight);
- the bytes this rank writes per checkpoint (its share after DCP's deduplication), the monitors' persistent state
  and their working set at a monitor step;
- the largest micro-batch that fits ``--gpu-gib`` (with and without activation checkpointing), after 2 GiB for the
  CUDA context and NCCL and 10% for allocator fragmentation.

Activations are counted from what this recipe's modules save for the backward, per token and layer (h = d_model,
f = FFN width, t = tensor parallel; e = 2 bytes under BF16 autocast, 4 in FP32; the residual stream is FP32): the
LayerNorms' FP32 inputs (4h each, divided by t under sequence parallelism), the inputs of the q/k/v, out_proj, fc_in
and fc_out products (e h, e h / t, e h, e f / t), q, k, v and O of the attention (4 e h / t), the FP32 copy of O of
fix=fp32_output (4 h / t), the GELU input (e f / t); an FP8 FFN (Transformer Engine) saves its BF16 input, the FP8
LayerNorm output and GELU output and the BF16 fc1 output instead. The output layer adds the logits and the FP32
softmax of the cross-entropy (e + 4 bytes per vocabulary entry of this rank, 8 more while it is formed). Flash
attention stores no scores. These are estimates: tests/unit/test_plan.py checks them against the resident memory of
a CPU run, scripts/plan_vs_gpu.py against a GPU's peak allocation (docs/parallelism.md, "Memory plan").
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from launcher.config import Config, ConfigError, load_config
from launcher.parallel.dims import ParallelDims
from launcher.parallel.names import named_parameters
from launcher.parallel.tensor import apply_tensor_parallel
from model import GPT

GIB = 2**30
CONTEXT_BYTES = 2 * GIB  # the CUDA context, NCCL's buffers and workspaces, outside PyTorch's allocator
FRAGMENTATION = 0.10  # share of the rest PyTorch's caching allocator is assumed to lose to fragmentation


@dataclass
class StagePlan:
    """The memory of the first rank of one pipeline stage, in bytes (activations per micro-batch; ``in_flight``
    micro-batches at once)."""

    stage: int
    layers: list[int]
    parameters: int  # elements this rank keeps (its tensor-parallel slice of its stage; ZeRO-3: its partition)
    weights: float = 0
    gradients: float = 0
    optimizer: float = 0
    buffers: float = 0
    activations: float = 0  # one micro-batch, without activation checkpointing
    activations_checkpointed: float = 0  # one micro-batch, with it (the blocks' inputs)
    loss_transient: float = 0  # on top of the saved activations while the last stage forms the loss
    transient: float = 0  # on top of them while a block's gradients are formed
    recompute: float = 0  # and under activation checkpointing the block being recomputed, whole
    head: float = 0  # what the output layer and the loss save (one micro-batch; last stage)
    in_flight: int = 1
    checkpoint_write: float = 0
    monitor_state: float = 0
    monitor_working: float = 0
    largest_micro_batch: dict[bool, int] = field(default_factory=dict)

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.monitor_state

    def peak(self, checkpointing: bool) -> float:
        """Training peak at the recipe's micro-batch (monitor steps add ``monitor_working``)."""
        saved = self.in_flight * (self.activations_checkpointed if checkpointing else self.activations)
        # the loss formed over every saved activation; or a block's backward, the output layer's already freed
        backward = self.transient + (self.recompute if checkpointing else 0) - self.head
        return self.static + saved + max(self.loss_transient, backward)


def layer_activation_bytes(config: Config, tp: int, tokens: int) -> tuple[float, float]:
    """(bytes one block saves for its backward for ``tokens`` tokens of one micro-batch, bytes it keeps under
    activation checkpointing: its input), per tensor-parallel rank; the module docstring's count."""
    m, p = config.model, config.parallel
    h, f = m.d_model, m.ffn_mult * m.d_model
    bf16 = config.precision.dtype == "bf16" or (config.precision.dtype == "auto" and config.run.device != "cpu")
    e = 2 if bf16 else 4
    sp = tp if p.sequence_parallel else 1
    norm = (4 * h + 8) / sp  # a LayerNorm's FP32 input, mean and inverse deviation
    # the q/k/v input; q, k, v and O; out_proj's input; the log-sum-exp per head
    attention = norm + e * h + 4 * e * h / tp + e * h / tp + 4 * m.n_head / tp
    if config.attention.fix == "fp32_output":  # (the fixed arms; a recipe's first arm may not have it)
        attention += 4 * h / tp
    if config.precision.fp8_ffn:
        ffn = 2 * h + 8 + h / sp + 2 * f / tp + f / tp
    else:
        ffn = norm + e * h + 2 * e * f / tp
    block_input = 4 * h / sp
    return tokens * (attention + ffn), tokens * block_input


def weight_copy_bytes(config: Config, block_params: int, ffn_params: int) -> float:
    """Bytes of weight copies one micro-batch keeps for its backward in one block: BF16 casts of the linear
    weights under autocast (the concatenated q/k/v weight in FP32 without it), FP8 casts and transposes in an FP8
    FFN."""
    bf16 = config.precision.dtype == "bf16" or (config.precision.dtype == "auto" and config.run.device != "cpu")
    attention = block_params - ffn_params
    qkv = 0.75 * attention  # q, k, v of q, k, v, out_proj (their norms and biases are negligible)
    if config.precision.fp8_ffn:
        ffn = 2 * ffn_params
    else:
        ffn = 2 * ffn_params if bf16 else 0
    return (2 * attention if bf16 else 4 * qkv) + ffn


def plan(config: Config, world: int, gpu_bytes: float = 79.6 * GIB) -> list[StagePlan]:
    """The memory plan of ``config`` on ``world`` processes (see the module docstring)."""
    from launcher.parallel.pipeline import layer_parameters, pipeline_layers, stage_layers

    m, p, d = config.model, config.parallel, config.data
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    dp = world // (tp * pp)
    with torch.device("meta"):
        model = GPT(m, seed=0)
    apply_tensor_parallel(model, ParallelDims(world_size=world, tp=tp, pp=pp, device=torch.device("meta")))
    names = {id(prm): n for n, prm in named_parameters(model)}
    if pp > 1:  # the stages as DeepSpeed cuts them (launcher/parallel/pipeline.py)
        layers = pipeline_layers(model, config)
        parts = stage_layers(layers, pp)
        held = [[prm for layer in layers[parts[s]:parts[s + 1]] for prm in layer_parameters(layer)] for s in range(pp)]
    else:
        held = [list(model.parameters())]
    accumulation = d.global_batch_size // (d.micro_batch_size * dp)
    tokens = d.micro_batch_size * d.seq_len
    plans = []
    for s, params in enumerate(held):
        unique = {id(prm): prm for prm in params}
        blocks = sorted({int(names[i].split(".")[1]) for i in unique if names[i].startswith("blocks.")})
        n = sum(prm.numel() for prm in unique.values())
        plans.append(_stage_plan(config, s, blocks, n, s == 0, s == len(held) - 1, tp, pp, dp, accumulation, tokens,
                                 model, gpu_bytes))
    return plans


def _stage_plan(config: Config, s: int, blocks: list[int], n: int, first: bool, last: bool, tp: int, pp: int, dp: int,
                accumulation: int, tokens: int, model: GPT, gpu_bytes: float) -> StagePlan:
    m, p = config.model, config.parallel
    zero = max(p.zero_stage, 1) if pp > 1 else p.zero_stage  # the pipeline always runs DeepSpeed's ZeRO-1
    block = model.blocks[0]
    block_params = sum(prm.numel() for prm in block.parameters())
    ffn_params = sum(prm.numel() for prm in block.mlp.parameters())
    plan = StagePlan(s, blocks, n if zero < 3 else math.ceil(n / dp))
    plan.weights = 4 * n / (dp if zero == 3 else 1)
    plan.gradients = 4 * n / (dp if zero >= 2 else 1)
    plan.optimizer = (8 + 4 * (zero > 0)) * n / (dp if zero else 1)  # Adam's moments; ZeRO's FP32 master partition
    if zero == 0 and dp > 1:
        plan.buffers = 4 * n  # DDP's gradient buckets (copies of the gradients)
    elif zero in (1, 2):
        plan.buffers = 4 * p.zero_reduce_bucket_size * (2 if p.zero_overlap_comm else 1)
    elif zero == 3:  # the block being run and the one prefetched, whole; the prefetch bucket
        plan.buffers = 4 * 2 * block_params + 4 * p.zero_prefetch_bucket_size
    per_layer, block_input = layer_activation_bytes(config, tp, tokens)
    copies = weight_copy_bytes(config, block_params, ffn_params)
    vocab = m.vocab_size / tp
    bf16 = config.precision.dtype == "bf16" or (config.precision.dtype == "auto" and config.run.device != "cpu")
    e = 2 if bf16 else 4
    ends = 8 * tokens if first else 0  # the token ids the embedding's backward keeps
    head = tokens * ((4 * m.d_model + 8) + e * m.d_model + (e + 4) * vocab) if last else 0
    layers = len(blocks)
    plan.activations = layers * (per_layer + copies) + ends + head
    plan.activations_checkpointed = layers * block_input + ends + head
    # on top of the saved activations: at the end of the last stage's forward the cross-entropy's FP32 temporaries;
    # later, in a block's backward, the gradients of two FFN-wide activations and, under activation checkpointing,
    # the block being recomputed
    plan.head = head
    plan.loss_transient = 8 * tokens * vocab if last else 0
    plan.transient = 2 * e * m.ffn_mult * m.d_model / tp * tokens
    plan.recompute = per_layer + copies
    plan.in_flight = min(pp - s, accumulation) if pp > 1 else 1
    plan.checkpoint_write = 12 * n / dp  # parameters and both moments, deduplicated over data parallel
    plan.monitor_state, plan.monitor_working = monitor_bytes(config, blocks, tp, zero == 3)
    usable = (gpu_bytes - CONTEXT_BYTES) * (1 - FRAGMENTATION)
    for checkpointing in (False, True):
        plan.largest_micro_batch[checkpointing] = largest_micro_batch(config, plan, checkpointing, usable, tokens)
    return plan


def largest_micro_batch(config: Config, plan: StagePlan, checkpointing: bool, usable: float, tokens: int) -> int:
    """The largest micro-batch size whose peak fits ``usable`` bytes (activations scale with the micro-batch; 0 if
    not even one sequence fits)."""
    per_sequence = (plan.activations_checkpointed if checkpointing else plan.activations) / tokens * \
        config.data.seq_len
    transient = max(plan.loss_transient, plan.transient + (plan.recompute if checkpointing else 0) - plan.head) / \
        tokens * config.data.seq_len
    room = usable - plan.static
    return max(0, int(room // (plan.in_flight * per_sequence + transient)))


def monitor_bytes(config: Config, blocks: list[int], tp: int, zero3: bool) -> tuple[float, float]:
    """(persistent, working) bytes of the monitors on a rank holding ``blocks`` (launcher/monitors/monitors.py, one
    layer at a time): the power-iteration vectors of its layers (replicated for column-parallel weights, split for
    row-parallel ones; its heads' for the per-head layers), the delta-bias state of its heads and the Q-K update's
    copy of its watched layers' W_Q and W_K; at a monitor step
    the largest of: a weight's fresh start (a d x d Gram matrix and its eigendecomposition; under ZeRO-3 the weight
    gathered), the probe's scores of one layer (FP32, this rank's heads), the delta bias's FP64 exact attention of
    one layer."""
    m, mon = config.model, config.monitor
    if not (mon.spectral_interval or mon.probe_interval):
        return 0.0, 0.0
    h, f, heads = m.d_model, m.ffn_mult * m.d_model, m.n_head / tp
    per_head = set(mon.per_head_layers(m.n_layer))
    vectors = sum((3 * h + h / tp + h + f / tp) + (2 * heads * h if i in per_head else 0) + h + h / tp
                  for i in blocks) * 4
    delta_layers = [i for i in mon.delta_layers(m.n_layer) if i in blocks]
    state = len(delta_layers) * (heads * (h // m.n_head) * h * 4 + heads * 8)
    if mon.qk_update and mon.spectral_interval:  # the Q-K update's copy of W_Q and W_K of its layers
        qk_layers = range(m.n_layer) if mon.qk_layers is None else mon.qk_layers
        state += sum(i in blocks for i in qk_layers) * 8 * h * h / tp
    b, t = mon.probe_batch_size, config.data.seq_len
    spectral = 3 * 4 * h * h + (4 * f * h / tp if zero3 else 0)
    probe = 2 * 4 * b * heads * t * t if mon.probe_interval else 0
    delta = 2 * 8 * b * heads * t * t if delta_layers and mon.probe_interval else 0
    return vectors + state, max(spectral if mon.spectral_interval else 0, probe, delta)


def describe(config: Config, world: int, plans: list[StagePlan], gpu_gib: float) -> str:
    m, p, d = config.model, config.parallel, config.data
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    dp = world // (tp * pp)
    total = 12 * m.n_layer * m.d_model ** 2 * (m.ffn_mult + 2) / 6 + (m.vocab_size + m.max_seq_len) * m.d_model
    lines = [f"{m.n_layer} x {m.d_model}, {m.n_head} heads, vocabulary {m.vocab_size}: ~{total / 1e9:.2f}B parameters",
             f"{world} processes = dp {dp} x tp {tp} x pp {pp}, ZeRO-{max(p.zero_stage, 1) if pp > 1 else p.zero_stage}"
             f"{', sequence parallel' if p.sequence_parallel else ''}, micro-batch {d.micro_batch_size} x {d.seq_len}, "
             f"{d.global_batch_size // (d.micro_batch_size * dp)} accumulation step(s); "
             f"{'FP8 FFN, ' if config.precision.fp8_ffn else ''}attention {config.attention.numerics}; GiB per rank:",
             ""]
    header = ("stage", "layers", "params", "grads", "optim", "buffers", "act/mb", "act/mb AC", "in flight",
              "peak", "peak AC", "ckpt write", "monitors", "mb fit", "mb fit AC")
    rows = []
    for s in plans:
        layers = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "-"
        rows.append((str(s.stage), layers, *(f"{v / GIB:.2f}" for v in (s.weights, s.gradients, s.optimizer,
                                                                          s.buffers, s.activations,
                                                                          s.activations_checkpointed)),
                     str(s.in_flight), f"{s.peak(False) / GIB:.1f}", f"{s.peak(True) / GIB:.1f}",
                     f"{s.checkpoint_write / GIB:.2f}", f"{s.monitor_state / GIB:.2f}+{s.monitor_working / GIB:.2f}",
                     str(s.largest_micro_batch[False]), str(s.largest_micro_batch[True])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    worst = max(plans, key=lambda s: s.peak(p.activation_checkpointing))
    peak = worst.peak(p.activation_checkpointing) + worst.monitor_working
    fits = peak <= (gpu_gib * GIB - CONTEXT_BYTES) * (1 - FRAGMENTATION)
    lines += ["", f"largest peak: stage {worst.stage}, {peak / GIB:.1f} GiB with this recipe's activation "
              f"checkpointing ({'on' if p.activation_checkpointing else 'off'}) at a monitor step: "
              f"{'fits' if fits else 'does NOT fit'} {gpu_gib:g} GiB (after {CONTEXT_BYTES / GIB:.0f} GiB context and "
              f"{FRAGMENTATION:.0%} fragmentation)"]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.field=value, as for launcher.pretrain")
    parser.add_argument("--world", type=int, default=0, help="processes (default: tensor x pipeline parallel)")
    parser.add_argument("--gpu-gib", type=float, default=79.6,
                        help="memory of one GPU in GiB (default 79.6: an 80 GB H100's 81,559 MiB)")
    args = parser.parse_intermixed_args(argv)
    try:
        probe = load_config(args.recipe, args.overrides)
        world = args.world or probe.parallel.tensor_parallel * probe.parallel.pipeline_parallel
        config = load_config(args.recipe, args.overrides, arm=_widest_arm(args.recipe, args.overrides),
                             world_size=world)
        if not config.model.vocab_size:
            raise ConfigError("set model.vocab_size (this recipe takes it from its data; the plan reads no data)")
        plans = plan(config, world, args.gpu_gib * GIB)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(describe(config, world, plans, args.gpu_gib))
    return 0


def _widest_arm(recipe: str, overrides: list[str]) -> Optional[str]:
    """The arm whose attention keeps the most for the backward (fix=fp32_output's FP32 copy of O), else the first."""
    from launcher.config import arm_names, load_recipe

    tree = load_recipe(recipe, overrides)
    arms = tree.get("arms") or {}
    for name in arm_names(tree):
        if (arms.get(name) or {}).get("attention", {}).get("fix") == "fp32_output":
            return name
    return None


if __name__ == "__main__":
    sys.exit(main())
