"""Typed run configuration: dataclasses with a docstring per field, loaded from a YAML recipe, overridable from the
command line (``section.field=value``), validated before anything starts.

A recipe is a YAML file whose top-level keys are the sections of :class:`Config`. It may also hold ``arms``: named
overrides of the ``attention`` section, one per arm of an experiment (e.g. ``baseline`` and ``fixed``). Arms may differ
only in attention numerics, so that a comparison of arms isolates the effect of flash-attention rounding.

``python -m launcher.pretrain --help-config`` prints every field with its docstring (read from this file).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from kernels.modes import (DELTA_REFERENCES, DELTA_SIGNS, FIXES, HEAD_DIMS as KERNEL_HEAD_DIMS, ROUNDINGS,
                          paper_block_keys_problem)
from launcher.warning_signals import WARNING_SIGNALS
from model.attention import BACKENDS, AttentionConfig
from model.gpt import GPTConfig


class ConfigError(ValueError):
    """A recipe or override the user must change; the message says what and how (``problems``: each problem, when
    the message lists several)."""

    def __init__(self, message: str, problems: Optional[list[str]] = None):
        super().__init__(message)
        self.problems = problems or [message]
        self.partial: Optional[tuple[Config, set[str]]] = None


@dataclass
class PrecisionConfig:
    """Number formats of the forward/backward pass."""

    dtype: str = "auto"
    """Autocast dtype of matmuls and attention: auto (bf16 on GPU, fp32 on CPU, where bf16 is slower), bf16, fp32.
    Master weights and optimizer state are always fp32."""
    fp8_ffn: bool = False
    """Run the FFN matrices (mlp.fc_in, mlp.fc_out) in FP8 through Transformer Engine (GPU only)."""
    fp8_recipe: str = "delayed"
    """Transformer Engine FP8 scaling recipe for the FFN: delayed (DelayedScaling: per-tensor scales from an amax
    history), current (Float8CurrentScaling: per-tensor scales from the tensor itself) or block (Float8BlockScaling:
    1x128 and 128x128 block scales, Hopper and newer)."""


@dataclass
class ParallelConfig:
    """How the model is laid out over processes; data parallelism takes the processes that remain
    (processes = data x tensor x pipeline parallel)."""

    tensor_parallel: int = 1
    """Tensor-parallel group size: Megatron-style column/row splits of attention (whole heads per rank) and FFN, and a
    vocabulary-split embedding and output layer. Must divide model.n_head, the FFN width and the vocabulary."""
    pipeline_parallel: int = 1
    """Pipeline stages (DeepSpeed's pipeline engine, 1F1B schedule; the blocks are split by parameter count and the
    gradient accumulation steps become its micro-batches). Runs with ZeRO stage 0 or 1 only."""
    zero_stage: int = 0
    """Sharding over data-parallel ranks: 0 = none (PyTorch DDP), 1 = optimizer state, 2 = + gradients,
    3 = + parameters (DeepSpeed ZeRO). Numerics are the same at every stage: FP32 weights and Adam state."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of storing them (less memory, ~1/3 more compute)."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism on top of tensor parallelism: between the tensor-parallel regions (LayerNorms,
    residuals, dropout) each rank keeps data.seq_len / tensor_parallel positions; the regions all-gather their input
    along the sequence and reduce-scatter their output instead of all-reducing (launcher/parallel/sequence.py). Same
    numerics, less activation memory and LayerNorm work. Needs tensor_parallel > 1 and data.seq_len divisible by it."""
    # -- communication overlap (docs/parallelism.md, "Overlap"); none of these changes the numerics
    tp_async_grad_reduce: bool = False
    """Tensor parallel (> 1): each MLP's fc_in and the output layer start the reduction of their input gradient
    (all-reduce; reduce-scatter under sequence_parallel) asynchronously and compute their weight gradient meanwhile, as
    Megatron does (not the attention's fused q/k/v product, which is the model's own). Off by
    default: the same products and sums, but in an order of our own instead of autograd's."""
    ddp_bucket_mb: int = 25
    """DDP (zero_stage=0) gradient bucket size in MiB: each full bucket is all-reduced while the backward goes on
    (25 is torch's default; larger buckets mean fewer, larger all-reduces and a later start)."""
    zero_overlap_comm: Optional[bool] = None
    """DeepSpeed ZeRO's overlap_comm: reduce (stage 1/2) gradient buckets, and under stage 3 also prefetch parameters,
    on a separate stream while the backward goes on. null: DeepSpeed's default (on for stage 3, off for 1 and 2)."""
    zero_contiguous_gradients: bool = True
    """DeepSpeed ZeRO's contiguous_gradients: copy gradients into one contiguous buffer as they are produced (less
    fragmentation, one copy per gradient); DeepSpeed's default."""
    zero_reduce_bucket_size: int = 500_000_000
    """DeepSpeed ZeRO's reduce_bucket_size: gradient elements reduced at a time (DeepSpeed's default 5e8; smaller
    buckets start reducing earlier in the backward, with overlap_comm on, at the cost of more collectives)."""
    zero_allgather_bucket_size: int = 500_000_000
    """DeepSpeed ZeRO-1/2's allgather_bucket_size: updated parameter elements all-gathered at a time after the step
    (DeepSpeed's default 5e8)."""
    zero_prefetch_bucket_size: int = 50_000_000
    """DeepSpeed ZeRO-3's stage3_prefetch_bucket_size: parameter elements fetched ahead of their use (DeepSpeed's
    default 5e7)."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay (the paper's schedule)."""

    lr: float = 1e-3
    """Peak learning rate reached at the end of warmup."""
    min_lr: float = 1e-5
    """Learning rate at the end of the cosine decay (held afterwards)."""
    warmup_steps: int = 2000
    """Optimizer steps of linear warmup from 0 to lr."""
    decay_steps: int = 0
    """Optimizer steps at which the cosine reaches min_lr; 0 means run.max_steps."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to matrices only (not to biases, norms, embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""


@dataclass
class DataConfig:
    """Token data and batch shape."""

    data_dir: str = "data/cache/kjv"
    """Folder with train.bin, val.bin and meta.json written by `python -m launcher.prepare_data`; the default is
    where the embedded corpus is prepared automatically on first use."""
    seq_len: int = 1024
    """Tokens per training sequence; at most model.max_seq_len."""
    global_batch_size: int = 320
    """Sequences per optimizer step summed over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one rank; global_batch_size must be a multiple of
    micro_batch_size x data-parallel size (the quotient is the number of gradient-accumulation steps)."""
    replay_from: str = ""
    """Path of a run's batch_offsets.bin: read each step's batch offsets from it instead of drawing them
    (the paper's replay). Empty: draw them from (run.seed, step)."""


@dataclass
class EvalConfig:
    """Held-out evaluation."""

    interval: int = 250
    """Evaluate every this many optimizer steps (and at the last step); 0 disables evaluation."""
    batches: int = 20
    """Micro-batches of the validation split per evaluation (always the same ones)."""


@dataclass
class MonitorConfig:
    """Live diagnostics of the paper's mechanism (spectral norms, tie rate, delta bias); 0 intervals disable."""

    spectral_interval: int = 100
    """Every this many steps, log spectral norms of W_Q, W_K, W_V, W_O, FFN matrices per layer and per head."""
    probe_interval: int = 100
    """Every this many steps, run the probe batch: activation norms, tie rate, max logit, entropy, delta bias."""
    probe_batch_size: int = 2
    """Sequences in the fixed probe batch (drawn once from the validation split)."""
    power_iterations: int = 3
    """Power-iteration steps per spectral-norm estimate (vectors persist across calls, so a few suffice)."""
    power_tolerance: float = 1e-4
    """Keep iterating (up to 8x power_iterations) while the estimate still rises by more than this per step."""
    delta_bias_layers: Optional[list[int]] = None
    """Layers whose delta bias is measured; null means the first four (0-3: the paper's failure is in layer 1). Each
    keeps a d_model x d_model FP32 state on its GPU and in every checkpoint, and its probe pass an FP64 T x T
    attention per head: list more layers only when the model is small."""
    head_layers: Optional[list[int]] = None
    """Layers whose per-head tags are logged (spectral/Lxx/wq/hyy and wk, attn/Lxx/hyy/*, delta_bias/Lxx/hyy/*,
    qk_update/Lxx/hyy/*, qk_act/Lxx/hyy/*); the other layers log their layer-wide tags only, which bounds the scalars
    per monitor step. null means the delta-bias layers; warning_layer is always one of them."""
    qk_update: bool = True
    """At every spectral call, the spectral entropy, stable rank and norm of the update of each head's query-key
    product W_Q,h^T W_K,h since the previous call, its first- and second-order terms apart (tags qk_update/...;
    launcher/monitors/qk_update.py). Keeps a copy of the qk_layers' W_Q and W_K (8 d^2 bytes per layer, divided by
    parallel.tensor_parallel) on the device and in checkpoints."""
    qk_activation: bool = True
    """At every probe call, the spectral entropy of the pre-softmax scores of qk_tokens probe tokens per head
    (tags qk_act/...)."""
    qk_tokens: int = 64
    """Probe tokens (evenly spaced over the probe batch, the same at every call) of the qk_activation entropy."""
    qk_layers: Optional[list[int]] = None
    """Layers of the qk_update and qk_activation monitors; null means all layers."""
    warning_layer: int = 1
    """Layer (global index) watched by the early warning (tag warning/on; launcher/monitors/warning.py); the paper's
    failing layer is 1. A layer the model does not have turns the warning off."""
    warning_tie_rate: float = 0.0
    """Warn when warning_layer's tie rate (attn/Lxx/tie_rate, mean over heads) is above this; 0 (the default)
    disables this part. It was the default (0.04) until the GPU calibration of 2026-12-03 (docs/results.md, "Early
    warning"): there it warned 1 of 3 diverging paper arms and none of the fa2 arms, in and out of sample (FP32
    scores have almost no exact ties)."""
    warning_wq_growth: float = 0.0
    """Warn when warning_layer's largest per-head W_Q spectral norm exceeds this factor x its value warning_window
    steps earlier; 0 (the default) disables this part. Off because in the margin grid of 2026-12-01 every arm's W_Q
    grew x2-x3 within 500 steps early in training (false alarms on 31-35 of 35 stable arms at x2 and x3)."""
    warning_window: int = 500
    """Steps over which warning_wq_growth is measured."""
    warning_after_step: int = 200
    """No warning before this step (tie rates and W_Q growth of the first steps and the warmup are not the failure)."""
    warning_patience: int = 2
    """Consecutive monitor steps on which a condition must hold before the warning turns on."""
    warning_wq_relative: float = 0.0
    """Warn when warning_layer's W_Q spectral-norm growth over warning_window steps is more than this factor x the
    median growth of the other layers' W_Q over the same steps; 0 disables (not calibrated yet)."""
    warning_dwq_cos: float = 0.0
    """Warn when warning_layer's delta_bias/Lxx/dwq_cos (successive W_Q-gradient errors alike) is above this; 0
    disables (not calibrated yet). Needs warning_layer in delta_bias_layers."""
    warning_delta_persistence: float = 0.0
    """Warn when |sum| / sum|.| of warning_layer's last warning_baseline delta-bias sums (1: one sign throughout) is
    above this; 0 disables (not calibrated yet). Needs warning_layer in delta_bias_layers."""
    warning_qk_update_drop: float = 0.0
    """Warn when some head's first-order Q-K update spectral entropy (qk_update/Lxx/hyy/entropy) of warning_layer
    falls more than this fraction below its mean over the previous warning_baseline spectral calls; 0 disables (not
    calibrated yet). Needs qk_update on warning_layer."""
    warning_qk_update2_drop: float = 0.0
    """The same drop for the second-order term's spectral entropy (qk_update/Lxx/hyy/entropy2); 0 disables."""
    warning_qk_srank_drop: float = 0.0
    """The same drop for the first-order term's stable rank (qk_update/Lxx/hyy/srank); 0 disables."""
    warning_qk_act_drop: float = 0.8647
    """The same drop for the pre-softmax score spectral entropy (qk_act/Lxx/hyy/entropy, every probe call); 0
    disables. The default rule: chosen on the H200 calibration grids of 2026-12-03 (dictionary text, 6 x 384, seed
    1337) and, on held-out grids (another text and BPE, 6 x 512, seed 2024), it warned 3 of 3 diverging paper arms
    and 1 of 1 fa2 arm, lead median 275 steps (min 115), with no false alarm on 8 stable arms (docs/results.md,
    "Early warning"). Reads qk_activation on warning_layer; where that monitor is off (probe_interval=0,
    qk_activation=false, warning_layer not in qk_layers) the default part is inactive, a value set explicitly is an
    error."""
    warning_baseline: int = 8
    """Monitor calls in the rolling baseline of the drop signals (warning_qk_*_drop) and in the delta-bias
    persistence window."""
    on_warning: str = "log"
    """What an onset of the early warning does: log (the console line and warning/on only); checkpoint (also save a
    checkpoint at the onset step and keep it as checkpoints/warning_step_N/, outside the two-kept rotation); stop
    (save, keep it, and end the run with exit status 4 and a one-line reason; SLURM does not requeue it);
    switch_fix (save, keep it, then train on with attention.fix=switch_fix_to, recorded in changes.yaml with its
    step; a resume continues with the switched fix). Later onsets after a switch are logged only."""
    switch_fix_to: str = "fp32_output"
    """The attention.fix on_warning=switch_fix switches to (fp32_output: delta from an FP32 copy of O, the fix with
    the widest measured margin, docs/results.md)."""

    def delta_layers(self, n_layer: int) -> list[int]:
        """The layers whose delta bias is measured (delta_bias_layers, with null resolved)."""
        return sorted(set(range(min(4, n_layer)) if self.delta_bias_layers is None else self.delta_bias_layers))

    def per_head_layers(self, n_layer: int) -> list[int]:
        """The layers whose per-head tags are logged (head_layers, with null resolved; warning_layer always, the
        early warning reads its per-head values)."""
        chosen = self.delta_layers(n_layer) if self.head_layers is None else self.head_layers
        return sorted(set(chosen) | ({self.warning_layer} & set(range(n_layer))))


@dataclass
class DistributedConfig:
    """Process groups and what happens when one of them hangs."""

    timeout_minutes: float = 10.0
    """A collective that waits longer than this (a dead, hung or far slower rank) ends the run with an error instead
    of hanging it; raise it if a checkpoint of a very large model takes longer on a slow file system."""
    flight_recorder_entries: int = 2000
    """NCCL's flight recorder: each process keeps its last N collectives (which group, which op, sizes, state) and
    writes them to <run.out_dir>/<experiment>/flight_recorder/rank_<r> when a collective times out, which names the
    rank and the collective a hang waits on (docs/training.md, "Hangs"); 0 turns it off. NCCL only."""


@dataclass
class GuardConfig:
    """What counts as a bad step and what to do about it."""

    action: str = "stop"
    """On NaN/inf loss or gradients, or a spike: stop (save nothing bad, exit with a message) or skip (drop the step)."""
    loss_spike_factor: float = 0.0
    """Treat a loss above this factor x its running mean as a spike; 0 disables."""
    grad_norm_spike_factor: float = 0.0
    """Treat a gradient norm above this factor x its running mean as a spike; 0 disables."""
    warmup_steps: int = 50
    """Steps before spike detection starts (running means need history)."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = 1000
    """Save every this many optimizer steps (and at the end, and on SIGINT/SIGTERM); 0 saves only then."""
    enabled: bool = True
    """false: never write a checkpoint (benchmarks; an interrupted run then starts over)."""
    resume: bool = True
    """Resume from the arm's latest checkpoint when one exists."""


@dataclass
class RunConfig:
    """Identity, length and placement of a run."""

    experiment: str = "default"
    """Experiment name; logs go to <out_dir>/<experiment>/<arm>/."""
    arm: str = "baseline"
    """Arm name within the experiment (set by the experiment launcher from the recipe's arms)."""
    out_dir: str = "runs"
    """Root folder of run outputs (TensorBoard events, checkpoints, batch offsets)."""
    seed: int = 1337
    """Seed of initialisation and of the batch sequence; arms of one experiment share it."""
    max_steps: int = 10000
    """Optimizer steps to train for."""
    max_minutes: float = 0.0
    """Wall-clock budget of this arm's training in this process (0: none). When it is spent, the step in progress
    ends, a checkpoint is written and the run stops as if interrupted; the same command continues it. The schedule
    still follows run.max_steps. For fixed-length allocations (a device call, a SLURM time limit)."""
    log_interval: int = 10
    """Print a progress line and write train/* scalars every this many steps."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cuda or cpu."""
    compile: bool = False
    """Wrap the model in torch.compile (GPU)."""
    overwrite: bool = False
    """Start over in a run folder that holds an earlier run: delete its events, checkpoints and batch offsets first
    (only with checkpoint.resume=false; without this, such a folder is refused)."""
    allow_changes: bool = False
    """Resume although settings that change the training differ from the checkpoint's (see SAFE_CHANGES in
    launcher/config.py for those that never need this); each change is recorded with the step it took effect in
    <run_dir>/changes.yaml. Without it such a resume is refused with the differences listed."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device for the MFU figure; 0 means look it up by device name (no MFU on CPU)."""


@dataclass
class Config:
    """One run (one arm) of a recipe."""

    model: GPTConfig = field(default_factory=GPTConfig)
    """Network shape."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """Attention implementation and rounding numerics."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Number formats."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data and batch shape."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Mechanism monitors."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Bad-step guards."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Collective timeout and hang diagnostics."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run identity and length."""
    arms: dict[str, dict] = field(default_factory=dict)
    """Arms of the experiment: name -> overrides of the attention section, e.g. {fixed: {attention: {fix: dynamic_max}}}."""

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.experiment / self.run.arm

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------------------------
# Loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, where: str, problems: list[str], failed: set[str]) -> Any:
    """Check ``value`` against the annotation ``tp`` and convert what YAML leaves ambiguous (1e-3 is a str there);
    a nested section's problems go to ``problems`` (see :func:`_build`), a leaf's are raised."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where, problems, failed)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, where, problems, failed)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, item, f"{where}[{i}]", problems, failed) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return copy.deepcopy(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and _is_int(value))):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
        if not math.isfinite(number):  # no field means anything by nan or inf (0 is "off" where there is an off)
            raise ConfigError(f"{where} must be a finite number, got {value}")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {_type_name(tp)}")


def _is_int(text: str) -> bool:
    try:
        int(text)
        return True
    except ValueError:
        return False


def _unknown_key_error(key: str, valid: list[str], where: str) -> ConfigError:
    hint = difflib.get_close_matches(key, valid, n=1)
    did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
    return ConfigError(f"unknown key '{where}{key}'.{did_you_mean} Valid keys{' in ' + where.rstrip('.') if where else ''}: "
                       f"{', '.join(valid)}")


def _build(cls: type, data: dict, where: str = "", problems: Optional[list[str]] = None,
           failed: Optional[set[str]] = None):
    """``cls`` from a mapping, every field checked. With ``problems``, each field's problem is appended to it (and
    its dotted name to ``failed``) and the field keeps its default, so that one pass finds them all; without, they
    are raised together."""
    collected = problems if problems is not None else []
    failed = failed if failed is not None else set()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    prefix = f"{where}." if where else ""
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            collected.append(str(_unknown_key_error(str(key), names, prefix)))
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}", collected, failed)
        except ConfigError as err:
            collected.append(str(err))
            failed.add(f"{prefix}{key}")
    if problems is None and collected:
        raise problems_error(collected)
    return cls(**kwargs)


def problems_error(problems: list[str]) -> ConfigError:
    """One ConfigError for every problem found: one line for one, a list for several."""
    problems = list(dict.fromkeys(problems))  # the same problem found twice (an arm's value and the recipe's)
    if len(problems) == 1:
        return ConfigError(problems[0])
    return ConfigError(f"invalid configuration ({len(problems)} problems):\n  - " + "\n  - ".join(problems),
                       problems)


def _mentions(problem: str, fields: set[str]) -> bool:
    """Whether ``problem`` is about one of ``fields`` (whose values could not be read, so it would mislead)."""
    return any(re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", problem) for f in fields)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ['optim.lr=3e-4', 'model.n_layer=4'] into a nested dict; values are parsed as YAML scalars/lists."""
    tree: dict = {}
    problems = []
    for item in overrides:
        if "=" not in item:
            problems.append(f"override '{item}' is not of the form section.field=value (e.g. optim.lr=3e-4)")
            continue
        key, raw = item.split("=", 1)
        if not key or "." not in key:
            problems.append(f"override '{item}' needs a section and a field, e.g. run.max_steps=100")
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        try:
            _set_path(tree, key.strip(), value)
        except ConfigError as err:
            problems.append(str(err))
    if problems:
        raise problems_error(problems)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def recipe_path(name_or_path: str) -> Path:
    """A recipe given as a path, or as a bare name of a file in recipes/ (e.g. 'smoke')."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = Path(__file__).resolve().parent.parent / "recipes" / f"{name_or_path}.yaml"
    if candidate.is_file():
        return candidate
    available = sorted(p.stem for p in candidate.parent.glob("*.yaml"))
    raise ConfigError(f"recipe '{name_or_path}' not found: give a YAML path or one of: {', '.join(available)}")


def load_recipe(name_or_path: str, overrides: Optional[list[str]] = None) -> dict:
    """The recipe as a plain dict with CLI overrides merged in (not yet typed or validated)."""
    path = recipe_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {err}") from None
    if data is None or data == {}:  # else it would silently train the defaults (GPT-2 small for 10,000 steps)
        raise ConfigError(f"recipe {path} is empty: write its sections (model:, data:, optim:, run:, ...), or start "
                          "from a copy of recipes/smoke.yaml")
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path} must be a mapping of sections (model:, optim:, ...)")
    extra = parse_overrides(overrides or [])
    _check_override_arms(data, extra)
    tree = _merge(data, extra)
    _check_not_replaced_by_arms(tree, extra)
    return tree


def _check_override_arms(recipe: dict, overrides: dict) -> None:
    """An override may set the recipe's arms, not add one: a misspelt arm name would silently become a new arm."""
    declared = recipe.get("arms")
    given = overrides.get("arms")
    if not isinstance(declared, dict) or not declared or not isinstance(given, dict):
        return
    for name in given:
        if name not in declared:
            hint = difflib.get_close_matches(str(name), list(declared), n=1)
            raise ConfigError(f"override arms.{name}...: the recipe has no arm '{name}'."
                              f"{' Did you mean ' + repr(hint[0]) + '?' if hint else ''} Its arms are: "
                              f"{', '.join(declared)} (a new arm goes into a recipe file)")


def _check_not_replaced_by_arms(tree: dict, overrides: dict) -> None:
    """An override of ``attention.<field>`` that the recipe's arms set anyway would be silently lost: refuse it."""
    arms = tree.get("arms") or {}
    given = overrides.get("attention") or {}
    if not isinstance(arms, dict) or not isinstance(given, dict):
        return
    for name in given:
        setting = [arm for arm, value in arms.items()
                   if isinstance(value, dict) and isinstance(value.get("attention"), dict) and name in value["attention"]]
        if setting:
            raise ConfigError(f"attention.{name}={given[name]} would be replaced by the recipe's arms "
                              f"({', '.join(setting)} set attention.{name}); set it per arm instead: "
                              + " ".join(f"arms.{arm}.attention.{name}=..." for arm in setting))


def arm_names(tree: dict) -> list[str]:
    """Arms declared by a recipe dict, in order; a recipe without arms has one arm, 'baseline'."""
    return list((tree.get("arms") or {}).keys()) or ["baseline"]


def build_config(tree: dict, arm: Optional[str] = None, world_size: Optional[int] = None) -> Config:
    """Typed, validated Config for one arm of a recipe dict (arm None: the recipe's first arm)."""
    if "margin" in tree:
        raise ConfigError("this recipe has a margin section (a grid of arms): run it with `python -m analysis.margin "
                          "RECIPE`, not launcher.pretrain")
    arms = tree.get("arms") or {}
    if not isinstance(arms, dict):
        raise ConfigError("'arms' must map arm names to overrides, e.g. arms: {fixed: {attention: {fix: dynamic_max}}}")
    names = arm_names(tree)
    arm = arm or names[0]
    if arms and arm not in arms:
        raise ConfigError(f"arm '{arm}' is not in the recipe; its arms are: {', '.join(names)}")
    arm_overrides = arms.get(arm) or {}
    if not isinstance(arm_overrides, dict):
        raise ConfigError(f"arms.{arm} must be a mapping like {{attention: {{fix: dynamic_max}}}}")
    problems: list[str] = []  # every problem of the recipe, found in one pass
    failed: set[str] = set()  # fields whose values could not be read: checks that use them would mislead
    extra = set(arm_overrides) - {"attention"}
    sections = [f.name for f in dataclasses.fields(Config) if f.name != "arms"]
    for key in sorted(extra, key=str):
        if key not in sections:  # a typo, not another section: suggest the one key an arm may hold
            problems.append(str(_unknown_key_error(str(key), ["attention"], f"arms.{arm}.")))
    if extra & set(sections):
        problems.append(f"arms.{arm} overrides {', '.join(sorted(extra & set(sections)))}; arms may differ only in "
                        "'attention' so that the comparison isolates attention numerics. Move those keys to the "
                        "recipe's top level.")
    top = tree.get("attention")
    if isinstance(top, dict) and arms:  # values every arm replaces are still checked where they are written
        top_config = _build(AttentionConfig, top, "attention", problems, failed)
        problems += [p for p in attention_problems(top_config, "attention")
                     if not p.startswith("attention.backend=sdpa has fixed") and not _mentions(p, failed)]
    attention_where = "attention"
    arm_attention = arm_overrides.get("attention")
    if isinstance(arm_attention, dict):  # the arm's problems name the arm
        attention_where = f"arms.{arm}.attention"
        readable = {}
        for key, value in arm_attention.items():
            before = len(problems)
            _build(AttentionConfig, {key: value}, attention_where, problems, failed)
            if len(problems) == before:
                readable[key] = value
            else:
                failed.add(f"attention.{key}")
        arm_attention = readable
    merged = _merge({k: v for k, v in tree.items() if k != "arms"},
                    {"attention": arm_attention} if arm_attention is not None else {})
    merged.setdefault("run", {})
    if not isinstance(merged["run"], dict):
        raise ConfigError(f"run must be a mapping of RunConfig fields, got {merged['run']!r}")
    merged["run"] = {**merged["run"], "arm": arm}
    config = _build(Config, {**merged, "arms": arms}, "", problems, failed)
    problems += [p for p in config_problems(config, world_size, attention_where) if not _mentions(p, failed)]
    if problems:
        err = problems_error(problems)
        err.partial = (config, failed)  # what could be read, for checks that come later (launcher/pretrain.py)
        raise err
    return config


def load_config(name_or_path: str, overrides: Optional[list[str]] = None, arm: Optional[str] = None,
                world_size: Optional[int] = None) -> Config:
    """Recipe file + overrides -> validated Config of one arm."""
    return build_config(load_recipe(name_or_path, overrides), arm, world_size)


# ----------------------------------------------------------------------------------------------------------------
# Validation


def _fp8_problems(m: GPTConfig, p: ParallelConfig, recipe: str) -> list[str]:
    """What prevents FP8 FFNs (Transformer Engine) from running this model and layout."""
    problems = []
    if p.activation_checkpointing and recipe == "delayed":
        problems.append("precision.fp8_recipe=delayed with parallel.activation_checkpointing=true: the recomputed "
                        "forward would quantize with the scales already updated for the next step, not those of the "
                        "forward it replays; use precision.fp8_recipe=current or block (no state), or turn "
                        "activation checkpointing off")
    hidden = m.ffn_mult * m.d_model
    if m.d_model % 16 or hidden % (16 * max(p.tensor_parallel, 1)):
        problems.append(f"FP8 matrix multiplies need dimensions divisible by 16: model.d_model={m.d_model} and the "
                        f"FFN width per tensor-parallel rank ({hidden} / {p.tensor_parallel}) must be; change "
                        "model.d_model")
    return problems


def _choice(value: str, choices: tuple, where: str) -> list[str]:
    return [] if value in choices else [f"{where}={value!r} is not one of: {', '.join(choices)}"]


def validate(config: Config, world_size: Optional[int] = None) -> None:
    """Raise ConfigError listing every problem found, each with what to change."""
    problems = config_problems(config, world_size)
    if problems:
        raise problems_error(problems)


def config_problems(config: Config, world_size: Optional[int] = None, attention_where: str = "attention") -> list[str]:
    """Every problem of a typed config, each with what to change (``attention_where``: where its attention section
    was written, for the messages)."""
    m, a, d, o, p, r = config.model, config.attention, config.data, config.optim, config.parallel, config.run
    problems: list[str] = []
    if m.n_head <= 0 or m.d_model % m.n_head:
        problems.append(f"model.n_head={m.n_head} must divide model.d_model={m.d_model}; "
                        f"pick a head count that divides {m.d_model}")
    for name in ("n_layer", "d_model", "max_seq_len", "ffn_mult"):
        if getattr(m, name) <= 0:
            problems.append(f"model.{name} must be positive")
    if m.vocab_size < 0:
        problems.append("model.vocab_size must be >= 0 (0: take it from the data)")
    if not 0.0 <= m.dropout < 1.0:
        problems.append(f"model.dropout={m.dropout} must be in [0, 1)")
    if d.seq_len > m.max_seq_len:
        problems.append(f"data.seq_len={d.seq_len} is longer than model.max_seq_len={m.max_seq_len}; "
                        f"lower data.seq_len or raise model.max_seq_len")
    if d.seq_len <= 0 or d.micro_batch_size <= 0 or d.global_batch_size <= 0:
        problems.append("data.seq_len, data.micro_batch_size and data.global_batch_size must be positive")
    elif world_size is None:
        problems += _batch_problems(config, 1, "")
    if a.backend != "sdpa" and m.n_head > 0 and m.d_model % m.n_head == 0 and m.head_dim not in KERNEL_HEAD_DIMS:
        heads = [m.d_model // hd for hd in KERNEL_HEAD_DIMS if m.d_model % hd == 0]
        fix = (f"model.n_head={heads[-1]}" if heads else
               f"model.d_model={max(64, round(m.d_model / 64) * 64)} (a multiple of 64)")
        problems.append(f"model.d_model / model.n_head = {m.head_dim} is not a head size the attention kernel supports "
                        f"({', '.join(map(str, KERNEL_HEAD_DIMS))}); for example set {fix}, or use "
                        "attention.backend=sdpa")
    problems += attention_problems(a, attention_where)
    if a.fix == "stochastic_output" and a.backend in ("triton", "gluon") and config.precision.dtype == "fp32":
        problems.append("attention.fix=stochastic_output rounds O to BF16 and the Triton and Gluon kernels take BF16 "
                        "inputs; set precision.dtype=bf16 (or auto), or attention.backend=reference (it rounds FP32 "
                        "inputs to BF16)")
    problems += _choice(config.precision.dtype, ("auto", "bf16", "fp32"), "precision.dtype")
    problems += _choice(config.precision.fp8_recipe, ("delayed", "current", "block"), "precision.fp8_recipe")
    if p.tensor_parallel < 1 or p.pipeline_parallel < 1:
        problems.append("parallel.tensor_parallel and parallel.pipeline_parallel must be >= 1")
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"parallel.zero_stage={p.zero_stage} must be 0 (DDP), 1, 2 or 3 (DeepSpeed ZeRO)")
    if p.pipeline_parallel > 1:
        if p.zero_stage > 1:
            problems.append(f"parallel.zero_stage={p.zero_stage} with parallel.pipeline_parallel="
                            f"{p.pipeline_parallel}: DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only "
                            "(ZeRO-2/3 shard gradients and parameters across the micro-batches the pipeline keeps in "
                            "flight); set parallel.zero_stage=1, or tensor_parallel instead of pipeline_parallel")
        if m.n_layer > 0 and p.pipeline_parallel > m.n_layer:
            problems.append(f"parallel.pipeline_parallel={p.pipeline_parallel} stages for model.n_layer={m.n_layer} "
                            "blocks: use at most one stage per block")
    if p.sequence_parallel:
        if p.tensor_parallel <= 1:
            problems.append("parallel.sequence_parallel=true splits the sequence over the tensor-parallel group and "
                            f"needs parallel.tensor_parallel > 1 (it is {p.tensor_parallel}); set "
                            "parallel.tensor_parallel=2 (or more), or parallel.sequence_parallel=false")
        elif d.seq_len > 0 and d.seq_len % p.tensor_parallel:
            fits = d.seq_len // p.tensor_parallel * p.tensor_parallel
            problems.append(f"data.seq_len={d.seq_len} is not divisible by parallel.tensor_parallel="
                            f"{p.tensor_parallel}, which parallel.sequence_parallel=true needs (each rank keeps "
                            f"seq_len / tensor_parallel positions); set data.seq_len={fits}, or "
                            "parallel.sequence_parallel=false")
    if p.ddp_bucket_mb <= 0 or min(p.zero_reduce_bucket_size, p.zero_allgather_bucket_size,
                                   p.zero_prefetch_bucket_size) <= 0:
        problems.append("parallel.ddp_bucket_mb, zero_reduce_bucket_size, zero_allgather_bucket_size and "
                        "zero_prefetch_bucket_size must be positive")
    if config.precision.fp8_ffn:
        problems += _fp8_problems(m, p, config.precision.fp8_recipe)
    if p.tensor_parallel > 1 and m.n_head > 0 and m.d_model > 0:
        problems += check_divisible(m.n_head, m.ffn_mult * m.d_model, m.vocab_size, p.tensor_parallel)
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        problems.append(f"optim.lr={o.lr} must be > 0 and optim.min_lr={o.min_lr} in [0, lr]")
    if o.warmup_steps < 0 or o.decay_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        problems.append("optim.warmup_steps, decay_steps, grad_clip and weight_decay must be >= 0")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        problems.append("optim.beta1 and optim.beta2 must be in [0, 1)")
    if r.max_steps <= 0:
        problems.append(f"run.max_steps={r.max_steps} must be positive")
    if not r.max_minutes >= 0:
        problems.append(f"run.max_minutes={r.max_minutes} must be >= 0 (0: no time limit)")
    if r.log_interval <= 0:
        problems.append("run.log_interval must be positive")
    if r.overwrite and config.checkpoint.resume:  # refused here, before anything is deleted
        problems.append("run.overwrite=true deletes the folder's earlier run, but checkpoint.resume=true (the default) "
                        "would continue it: add checkpoint.resume=false to start over, or drop run.overwrite=true")
    problems += _choice(r.device, ("auto", "cuda", "cpu"), "run.device")
    problems += _choice(config.guard.action, ("stop", "skip"), "guard.action")
    if config.eval.interval < 0 or config.checkpoint.interval < 0:
        problems.append("eval.interval and checkpoint.interval must be >= 0")
    mon = config.monitor
    if mon.spectral_interval < 0 or mon.probe_interval < 0 or mon.probe_batch_size <= 0 or mon.power_iterations <= 0 \
            or mon.power_tolerance < 0:
        problems.append("monitor intervals and power_tolerance must be >= 0, probe_batch_size and power_iterations > 0")
    problems += monitor_problems(config)
    if config.distributed.timeout_minutes <= 0 or config.distributed.flight_recorder_entries < 0:
        problems.append("distributed.timeout_minutes must be > 0 and distributed.flight_recorder_entries >= 0 "
                        "(0 turns the flight recorder off)")
    for name in ("delta_bias_layers", "head_layers"):
        for layer in getattr(mon, name) or []:
            if not 0 <= layer < m.n_layer:
                problems.append(f"monitor.{name} has layer {layer}; layers are 0..{m.n_layer - 1}")
    for name in (r.experiment, r.arm):
        if not name or any(c in name for c in "/\\ ") or name.startswith("."):
            problems.append(f"run name {name!r} must be a plain folder name (no slashes or spaces)")
    if world_size is not None and not problems:
        problems += layout_problems(config, world_size)
    return problems


ON_WARNING = ("log", "checkpoint", "stop", "switch_fix")


# each signal's default threshold (the shipped rule), which may rest silently where its monitor is off
_MONITOR_DEFAULTS = {s: getattr(MonitorConfig, f"warning_{s}") for s in WARNING_SIGNALS}


def warning_inputs_on(config: Config) -> dict[str, bool]:
    """Per early-warning signal: are its inputs measured on monitor.warning_layer with these monitor settings?"""
    mon, layer = config.monitor, config.monitor.warning_layer
    qk_watched = mon.qk_layers is None or layer in mon.qk_layers
    update_on = mon.qk_update and mon.spectral_interval > 0 and qk_watched
    delta_on = mon.probe_interval > 0 and layer in mon.delta_layers(config.model.n_layer)
    return {"tie_rate": mon.probe_interval > 0, "wq_growth": mon.spectral_interval > 0,
            "wq_relative": mon.spectral_interval > 0, "dwq_cos": delta_on, "delta_persistence": delta_on,
            "qk_update_drop": update_on, "qk_update2_drop": update_on, "qk_srank_drop": update_on,
            "qk_act_drop": mon.qk_activation and mon.probe_interval > 0 and qk_watched}


def monitor_problems(config: Config) -> list[str]:
    """Problems of the monitor section: intervals, the early-warning rule's inputs and what an onset does."""
    mon, m = config.monitor, config.model
    problems = []
    thresholds = {s: getattr(mon, f"warning_{s}") for s in WARNING_SIGNALS}
    if any(not t >= 0 for t in thresholds.values()) or mon.warning_window <= 0 or mon.warning_patience < 1 \
            or mon.warning_layer < 0 or mon.warning_after_step < 0 or mon.warning_baseline < 2:
        problems.append("monitor.warning_<signal> thresholds must be >= 0 (0 disables), warning_window > 0, "
                        "warning_patience >= 1, warning_baseline >= 2, warning_layer and warning_after_step >= 0")
    if mon.qk_tokens < 2:
        problems.append(f"monitor.qk_tokens={mon.qk_tokens} must be >= 2")
    for layer in mon.qk_layers or []:
        if not 0 <= layer < m.n_layer:
            problems.append(f"monitor.qk_layers has layer {layer}; layers are 0..{m.n_layer - 1}")
    layer = mon.warning_layer
    switches = {"qk_update_drop": "monitor.qk_update", "qk_update2_drop": "monitor.qk_update",
                "qk_srank_drop": "monitor.qk_update", "qk_act_drop": "monitor.qk_activation"}
    inputs_on = warning_inputs_on(config)
    for signal, switch in switches.items():
        # the default rule simply rests where its monitor is off; a threshold the user chose must be readable
        if thresholds[signal] > 0 and not inputs_on[signal] and thresholds[signal] != _MONITOR_DEFAULTS[signal]:
            problems.append(f"monitor.warning_{signal}={thresholds[signal]:g} reads {switch} of layer {layer}, which "
                            f"is off; set {switch}=true with its interval > 0 and monitor.warning_layer in "
                            f"monitor.qk_layers, or monitor.warning_{signal}=0")
    for signal in ("dwq_cos", "delta_persistence"):
        if thresholds[signal] > 0 and not inputs_on[signal]:
            problems.append(f"monitor.warning_{signal}={thresholds[signal]:g} reads the delta bias of layer {layer}, "
                            f"which is not measured; add {layer} to monitor.delta_bias_layers (and a probe_interval "
                            f"> 0), or set monitor.warning_{signal}=0")
    problems += _choice(mon.on_warning, ON_WARNING, "monitor.on_warning")
    problems += _choice(mon.switch_fix_to, tuple(f for f in FIXES if f != "none"), "monitor.switch_fix_to")
    if mon.on_warning != "log":
        active = any(t > 0 and inputs_on[s] for s, t in thresholds.items()) and layer < m.n_layer
        if not active:
            problems.append(f"monitor.on_warning={mon.on_warning} acts on the early warning, which is off (every "
                            "monitor.warning_<signal> is 0 or reads a monitor that is off, or warning_layer is not a "
                            "layer of the model); set a threshold its monitor measures, or monitor.on_warning=log")
        if not config.checkpoint.enabled:
            problems.append(f"monitor.on_warning={mon.on_warning} saves a checkpoint at the onset, but "
                            "checkpoint.enabled=false; set checkpoint.enabled=true or monitor.on_warning=log")
    if mon.on_warning == "switch_fix":
        switched = dataclasses.replace(config.attention, fix=mon.switch_fix_to)
        problems += [f"monitor.switch_fix_to={mon.switch_fix_to}: {p}" for p in attention_problems(switched, "attention")]
        if config.parallel.pipeline_parallel > 1 and switched.needs_noise_keys != config.attention.needs_noise_keys:
            problems.append(f"monitor.switch_fix_to={mon.switch_fix_to} changes whether the attention draws random "
                            "bits, which a pipeline's layers cannot change mid-run; choose another fix (e.g. "
                            "fp32_output) or parallel.pipeline_parallel=1")
    return problems


def attention_problems(a: AttentionConfig, where: str) -> list[str]:
    """Problems of one attention section (``where``: its place in the recipe, for the messages)."""
    problems = _choice(a.backend, BACKENDS, f"{where}.backend")
    problems += _choice(a.rounding, ROUNDINGS, f"{where}.rounding")
    problems += _choice(a.fix, FIXES, f"{where}.fix")
    problems += _choice(a.delta_sign, DELTA_SIGNS, f"{where}.delta_sign")
    problems += _choice(a.delta_reference, DELTA_REFERENCES, f"{where}.delta_reference")
    problems += _choice(a.output_sign, DELTA_SIGNS, f"{where}.output_sign")
    if not (math.isfinite(a.delta_gain) and a.delta_gain >= 0):
        problems.append(f"{where}.delta_gain={a.delta_gain} must be a finite number >= 0 (1.0: the mode's own "
                        "numerics; 0: fix=fp32_output's delta)")
    if not (math.isfinite(a.output_gain) and a.output_gain >= 0):
        problems.append(f"{where}.output_gain={a.output_gain} must be a finite number >= 0 (1.0: the mode's own "
                        "numerics; 0: the FP32 O rounded once)")
    if a.backend == "sdpa" and ((a.rounding, a.fix) != ("fa2", "none") or a.stresses_delta or a.stresses_output):
        # the message's start is matched by build_config (values every arm replaces)
        stress = f", delta_gain={a.delta_gain:g}, delta_sign={a.delta_sign}" if a.stresses_delta else ""
        stress += f", output_gain={a.output_gain:g}, output_sign={a.output_sign}" if a.stresses_output else ""
        problems.append(f"attention.backend=sdpa has fixed production numerics; rounding={a.rounding}, fix={a.fix}"
                        f"{stress} needs attention.backend=triton, reference or auto")
    if a.fix.startswith("dynamic_max") and a.beta <= 1.0:
        problems.append(f"{where}.beta={a.beta} must be > 1 (the maximum is shifted by (beta - 1) x max)")
    if a.eps < 0:
        problems.append(f"{where}.eps={a.eps} must be >= 0")
    tile_problem = paper_block_keys_problem(a.paper_block_keys)
    if tile_problem:
        problems.append(f"{where}.{tile_problem}")
    return problems


def _batch_problems(config: Config, dp: int, dp_text: str) -> list[str]:
    d = config.data
    if d.global_batch_size % (d.micro_batch_size * dp) == 0:
        return []
    micro = [m for m in range(1, d.micro_batch_size + 1) if d.global_batch_size % (m * dp) == 0]
    fix = (f"data.micro_batch_size={micro[-1]}" if micro else
           f"data.global_batch_size={-(-d.global_batch_size // (d.micro_batch_size * dp)) * d.micro_batch_size * dp}")
    return [f"data.global_batch_size={d.global_batch_size} is not a multiple of data.micro_batch_size="
            f"{d.micro_batch_size}{dp_text}; for example set {fix}"]


def environment_problems(config: Config, unread: frozenset[str] = frozenset()) -> list[str]:
    """What this machine cannot do of ``config`` (devices, Transformer Engine, the output folder), each with what to
    change; checked before anything is created. ``unread``: fields whose values could not be read (left out)."""
    import importlib.util
    import os
    import tempfile

    import torch

    problems = []
    cuda = torch.cuda.is_available()
    if config.run.device == "cuda" and not cuda:
        problems.append("run.device=cuda but no CUDA GPU is visible; use run.device=auto or cpu")
    on_gpu = cuda and config.run.device != "cpu"
    if config.attention.backend in ("triton", "gluon") and not on_gpu:
        problems.append(f"attention.backend={config.attention.backend} needs a CUDA GPU; use attention.backend=auto "
                        "(the PyTorch reference of the same numerics on CPU) or reference")
    attention = config.attention
    if attention.fix == "stochastic_output" and on_gpu and attention.backend == "auto" \
            and config.precision.dtype == "fp32":
        problems.append("attention.fix=stochastic_output on a GPU runs the Triton kernel, which takes BF16 inputs; set "
                        "precision.dtype=bf16 (or auto)")
    mon = config.monitor
    if mon.on_warning == "switch_fix" and mon.switch_fix_to == "stochastic_output" and on_gpu \
            and attention.backend == "auto" and config.precision.dtype == "fp32":
        problems.append("monitor.switch_fix_to=stochastic_output on a GPU runs the Triton kernel, which takes BF16 "
                        "inputs; set precision.dtype=bf16 (or auto), or another monitor.switch_fix_to")
    if config.precision.fp8_ffn:
        if not on_gpu:
            problems.append("precision.fp8_ffn=true needs a CUDA GPU; set precision.fp8_ffn=false on this machine")
        elif importlib.util.find_spec("transformer_engine") is None:
            problems.append("precision.fp8_ffn=true needs Transformer Engine: pip install -e '.[gpu]' on this GPU "
                            "machine, or set precision.fp8_ffn=false")
    out = Path(config.run.out_dir).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        problems.append(f"run.out_dir={config.run.out_dir}: {existing} is a file, not a folder; choose another run.out_dir")
    else:
        try:  # os.access is not enough (read-only file systems, /proc): try to create a folder there
            tempfile.TemporaryDirectory(dir=existing).cleanup()
        except OSError as err:
            problems.append(f"run.out_dir={config.run.out_dir}: cannot create folders in {existing} "
                            f"({os.strerror(err.errno) if err.errno else err}); choose a writable run.out_dir")
    return [p for p in problems if not _mentions(p, set(unread))]


def check_layout(world_size: int, parallel: ParallelConfig) -> list[str]:
    """Problems (each saying what to change) with laying ``world_size`` processes out as dp x tp x pp."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    if tp < 1 or pp < 1:
        return ["parallel.tensor_parallel and parallel.pipeline_parallel must be >= 1"]
    if world_size % (tp * pp):
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return [f"{world_size} process(es) cannot be split into tensor_parallel={tp} x pipeline_parallel={pp} x "
                f"data parallel: tensor_parallel x pipeline_parallel must divide the process count; "
                f"products that do: {', '.join(map(str, fits))}"]
    return []


def check_divisible(n_head: int, ffn_hidden: int, vocab_size: Optional[int], tp: int) -> list[str]:
    """Problems (each with what to change) that prevent splitting the model over ``tp`` ranks."""
    problems = []
    if tp <= 1:
        return problems
    if n_head % tp:
        problems.append(f"model.n_head={n_head} is not divisible by parallel.tensor_parallel={tp} (each rank takes "
                        f"whole heads); choose a head count that is a multiple of {tp} or another tensor_parallel")
    if ffn_hidden % tp:
        problems.append(f"the FFN width {ffn_hidden} (model.ffn_mult x model.d_model) is not divisible by "
                        f"parallel.tensor_parallel={tp}; change model.d_model or tensor_parallel")
    if vocab_size and vocab_size % tp:
        padded = -(-vocab_size // tp) * tp
        problems.append(f"the vocabulary ({vocab_size}) is not divisible by parallel.tensor_parallel={tp}; set "
                        f"model.vocab_size={padded} (ids above the data's vocabulary are never used)")
    return problems


def resolve_vocab_size(config: Config, data_vocab_size: int) -> Config:
    """``config`` with ``model.vocab_size`` resolved against the data's vocabulary (0: take the data's), as a new
    Config (the given one is left as it is). Raises ConfigError if the model's vocabulary is smaller than the data's
    or does not split over the tensor-parallel ranks (checked here because 0 is only known once the data is open)."""
    m = config.model
    if m.vocab_size and m.vocab_size < data_vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary "
                          f"({data_vocab_size}); set model.vocab_size=0 to take it from the data")
    vocab_size = m.vocab_size or data_vocab_size
    problems = check_divisible(m.n_head, m.ffn_mult * m.d_model, vocab_size, config.parallel.tensor_parallel)
    if problems:
        raise ConfigError("; ".join(problems))
    return dataclasses.replace(config, model=dataclasses.replace(m, vocab_size=vocab_size))


def parameter_estimate(config: Config) -> tuple[float, int]:
    """(parameters, vocabulary) of the model without building it: 12 x layers x d_model^2 for blocks with a 4x FFN
    (scaled for other widths), plus the embedding. model.vocab_size=0 takes the prepared data's vocabulary from its
    meta.json, or GPT-2's padded 50,304 while the data is not prepared yet."""
    import json

    m = config.model
    vocab = m.vocab_size
    if not vocab:
        try:
            vocab = int(json.loads((Path(config.data.data_dir) / "meta.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            vocab = 50304
    return 12 * m.n_layer * m.d_model ** 2 * (m.ffn_mult + 2) / 6 + vocab * m.d_model, vocab


def layout_problems(config: Config, world_size: int) -> list[str]:
    """Problems of running ``config`` on ``world_size`` processes, each naming values that work."""
    p, d = config.parallel, config.data
    problems = check_layout(world_size, p)
    if problems:
        return problems
    dp = world_size // (p.tensor_parallel * p.pipeline_parallel)
    problems = _batch_problems(config, dp, f" x data-parallel size {dp} ({world_size} process(es) / (tensor_parallel "
                                           f"{p.tensor_parallel} x pipeline_parallel {p.pipeline_parallel}))")
    windows = config.eval.batches * d.micro_batch_size
    if config.eval.interval and p.pipeline_parallel > 1 and config.eval.batches % dp:
        # the pipeline evaluates whole micro-batches only
        problems.append(f"eval.batches={config.eval.batches} is not a multiple of the data-parallel size {dp}, which "
                        f"pipeline parallelism needs (whole micro-batches per rank); for example set eval.batches="
                        f"{-(-config.eval.batches // dp) * dp}")
    elif config.eval.interval and windows % dp:
        batches = -(-config.eval.batches // dp) * dp
        problems.append(f"eval.batches={config.eval.batches} x data.micro_batch_size={d.micro_batch_size} = {windows} "
                        f"validation sequences cannot be split evenly over {dp} data-parallel ranks; for example set "
                        f"eval.batches={batches}")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# Resuming with other settings

SAFE_CHANGES = (
    "run.max_steps", "run.max_minutes", "run.log_interval", "run.out_dir", "run.experiment", "run.arm",
    "run.compile", "run.peak_tflops", "eval.interval", "monitor.spectral_interval", "monitor.probe_interval",
    "checkpoint.interval", "checkpoint.enabled", "data.micro_batch_size", "parallel.*", "distributed.*", "arms",
    "monitor.on_warning", "monitor.switch_fix_to",
)
"""Fields a resumed run may change without run.allow_changes: they say how long to train, how often to log, evaluate,
monitor and save, where the outputs go and under which names (a checkpoint copied into another folder), and how the
same computation is laid out over processes (every layout computes the same steps; docs/parallelism.md).
run.max_steps is safe because the comparison is made on the effective schedule: with optim.decay_steps=0 the cosine
ends at run.max_steps, so a new run.max_steps changes the effective optim.decay_steps, and that change is not safe.
``arms`` holds the other arms' settings; this arm's are in ``attention``. What an early-warning onset does
(monitor.on_warning, switch_fix_to) is safe: a switch it makes is recorded in changes.yaml when it happens. run.allow_changes, run.overwrite and
checkpoint.resume say how to start and are not compared. Everything else (learning rate, schedule,
model, data, seed, attention numerics, precision, guard, evaluation batches, ...) changes what is trained or measured."""


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key != "arms":
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _effective(tree: dict) -> dict[str, Any]:
    flat = _flatten(tree)
    if not flat.get("optim.decay_steps"):  # 0 means run.max_steps: compare the schedule actually followed
        flat["optim.decay_steps"] = flat.get("run.max_steps")
    return flat


def _is_safe(name: str) -> bool:
    return any(name == s or (s.endswith(".*") and name.startswith(s[:-1])) for s in SAFE_CHANGES)


def config_changes(trained: dict, now: Config) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """(safe, unsafe) differences between the config a checkpoint was trained with and ``now``, as
    {dotted field: (trained value, new value)}; fields the checkpoint's config lacks (older code) are ignored."""
    before, after = _effective(trained), _effective(now.to_dict())
    commands = ("run.allow_changes", "run.overwrite", "checkpoint.resume")  # how to start, not what trains
    diffs = {k: (before[k], after[k]) for k in after
             if k in before and before[k] != after[k] and k not in commands}
    safe = {k: v for k, v in diffs.items() if _is_safe(k)}
    return safe, {k: v for k, v in diffs.items() if k not in safe}


def changes_refusal(unsafe: dict[str, tuple], step: int, run_dir: Path) -> str:
    """The message of a resume refused for settings that change the training."""
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(unsafe.items()))  # trained -> asked
    hint = ""
    if "optim.decay_steps" in unsafe:
        hint = (f" (optim.decay_steps=0 ends the cosine at run.max_steps; to change run.max_steps on the same "
                f"schedule, set optim.decay_steps={unsafe['optim.decay_steps'][0]})")
    return (f"{run_dir} was trained to step {step} with other settings: {listed}{hint}. Resuming would change the "
            "training and the folder would no longer say what trained: give the settings it was trained with again "
            "(drop those overrides, or undo the edit of the recipe file) to continue the run as it was, use another "
            "run.experiment (or checkpoint.resume=false run.overwrite=true) to start over with "
            "them, or set run.allow_changes=true to continue with them (recorded in changes.yaml)")


# ----------------------------------------------------------------------------------------------------------------
# Help text from the field docstrings


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass, read from its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe() -> str:
    """Every configurable field with its type, default and docstring, section by section."""
    lines = []
    for section in dataclasses.fields(Config):
        if section.name == "arms":
            lines.append(f"arms: {field_docs(Config)['arms']}\n")
            continue
        cls = section.default_factory  # type: ignore[misc]
        lines.append(f"{section.name}:  ({cls.__doc__.strip().splitlines()[0]})")
        docs = field_docs(cls)
        default = cls()
        for f in dataclasses.fields(cls):
            lines.append(f"  {section.name}.{f.name} = {getattr(default, f.name)!r}")
            lines.append(f"      {docs.get(f.name, '')}")
        lines.append("")
    return "\n".join(lines)
