"""One optimizer step behind one interface, whatever wraps the model: plain PyTorch / DDP, or DeepSpeed ZeRO.

Engines only wrap: the model arrives with tensor parallelism, attention, device, FP8, activation checkpointing and
the ZeRO-3 switches already applied (launcher/parallelize.py), and no engine changes it. The pipeline engine is in
pipeline.py; launcher/parallel/build.py picks the engine of a layout.

The trainer calls, per optimizer step::

    loss = engine.forward_backward(micro_batches, autocast)   # gradients, reduced over data-parallel ranks
    grad_norm, problem = engine.step(lr, veto)                # veto(grad_norm) -> None, or why not to update

``veto`` (the trainer's guard) is consulted once the global gradient norm is known and before anything is updated:
on an objection, parameters and optimizer state stay exactly as they were and the gradients are dropped.
A micro-batch is (inputs, targets), or (inputs, targets, row_keys) when the attention draws random bits
(``AttentionConfig.needs_noise_keys``); the keys go to the model's forward as its third argument.
Checkpoints go through :meth:`Engine.state_pieces` (what this rank holds of each parameter and of its Adam moments:
the tensors themselves, or their ZeRO partitions, never assembled) and :meth:`Engine.prepare_state_load` /
:meth:`Engine.finish_state_load` (the same pieces as destinations); launcher/checkpoint.py writes and reads them
under the single-device model's names and shapes, which is what lets a checkpoint outlive its layout.

- :class:`LocalEngine`: one process, or DDP over the data-parallel group (``parallel.zero_stage=0``); AdamW
  from torch; the gradient norm sums split parameters over the tensor-parallel group.
- :class:`ZeroEngine`: DeepSpeed ZeRO stage 1, 2 or 3 over the data-parallel group (the tensor-parallel group is
  handed to DeepSpeed as its "mpu"). The same torch AdamW; FP32 parameters, gradients, gradient reduction and Adam
  state; BF16 autocast in the forward. That is DeepSpeed's ``torch_autocast`` mode with no module allowed to reduce
  its gradients in BF16 (``lower_precision_safe_modules: []``). DeepSpeed's ``bf16`` mode is not used: it keeps BF16
  weights and runs the whole forward in BF16, which is not the paper's setting (FP32 master weights, BF16 autocast)
  and would change the numerics the experiment compares.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from launcher.config import Config
from launcher.parallel.dims import ParallelDims
from launcher.parallel.names import named_parameters
from launcher.parallel.tensor import shard_of

ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
PARAM = "param"  # the key of a parameter's own value among a piece's keys (the others: ADAM_STATE_KEYS)


@dataclass
class Piece:
    """What this rank holds of one parameter's tensor-parallel slice (``key`` PARAM), or of one of its Adam moments:
    elements [start, start + data.numel()) of the slice, of shape ``local_shape``, flattened row-major. ``data`` is a
    view of where the values live (the parameter or moment itself, or this rank's ZeRO partition of it), flat, or the
    whole slice in its own shape."""

    name: str
    key: str
    param: nn.Parameter
    local_shape: tuple[int, ...]
    start: int
    data: torch.Tensor


def autocast_dtype(config: Config, device: torch.device) -> str:
    """The forward's autocast dtype: precision.dtype, with auto = bf16 on a GPU and fp32 on a CPU (BF16 is slower
    than FP32 on the CPUs this recipe runs its tests on)."""
    dtype = config.precision.dtype
    return ("bf16" if device.type == "cuda" else "fp32") if dtype == "auto" else dtype


def build_optimizer(model: nn.Module, config: Config, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, LayerNorm gains or embeddings)."""
    optim = config.optim
    embeddings = {id(m.weight) for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
                  and (isinstance(m, nn.Embedding) or type(m).__name__ == "VocabParallelEmbedding")}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            matrix = len(getattr(p, "ds_shape", p.shape)) >= 2  # a ZeRO-3 partition keeps its shape in ds_shape
            (decay if matrix and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.adam_eps,
                             fused=device.type == "cuda")


def tensor_parallel_grad_norm(params: list[nn.Parameter], dims: ParallelDims) -> torch.Tensor:
    """L2 norm of the gradients of the whole model: split parameters summed over the tensor-parallel group,
    replicated ones (identical on every rank of it) counted once, by tensor-parallel rank 0."""
    split = [p.grad for p in params if p.grad is not None and shard_of(p) is not None]
    replicated = [p.grad for p in params if p.grad is not None and shard_of(p) is None] if dims.tp_rank == 0 else []
    squares = torch.zeros((), device=dims.device, dtype=torch.float32)
    for grads in (split, replicated):
        if grads:
            squares = squares + torch.nn.utils.get_total_norm(grads).float().square()
    if dims.tp > 1:
        dist.all_reduce(squares, group=dims.tp_group)
    return squares.sqrt()


class Engine:
    """Interface of an engine (see the module docstring); ``model`` is the module it trains: what
    launcher/parallelize.py made of the model (the whole model, or under a pipeline this rank's stage), wrapped here,
    never changed."""

    model: nn.Module
    dims: ParallelDims
    zero_stage: int = 0
    """DeepSpeed ZeRO stage of the optimizer (0: none)."""

    def train_step(self, micro_batches: list[tuple[torch.Tensor, ...]],
                   autocast: Callable[[], contextlib.AbstractContextManager], lr: float,
                   veto: Callable[[float, float], Optional[str]]) -> tuple[float, float, Optional[str]]:
        """One optimizer step over this rank's micro-batches at learning rate ``lr``, unless ``veto(loss, global
        gradient norm)`` objects once both are known (then nothing is updated). Returns (the loss: mean over the
        micro-batches and data-parallel ranks, the norm, the objection or None); identical on every rank."""
        loss = self.forward_backward(micro_batches, autocast)
        if self.dims.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.dp_group)
        loss_value = loss.item()
        norm, problem = self.step(lr, lambda norm: veto(loss_value, norm))
        return loss_value, norm, problem

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, ...]],
                         autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches; returns their mean loss (a 0-d tensor, this rank)."""
        raise NotImplementedError

    def step(self, lr: float, veto: Callable[[float], Optional[str]]) -> tuple[float, Optional[str]]:
        """Clip and apply this step's gradients at learning rate ``lr`` unless ``veto(global gradient norm)`` objects;
        returns (the norm, the objection or None). Every rank must get the same answer from ``veto``."""
        raise NotImplementedError

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                  autocast: Callable[[], contextlib.AbstractContextManager]) -> tuple[float, int]:
        """(Sum of the per-sequence mean losses, number of sequences) of this rank's evaluation batches."""
        total, count = torch.zeros((), dtype=torch.float64, device=self.dims.device), 0
        self.model.eval()
        try:
            for x, y in batches:
                with autocast():
                    _, loss = self.model(x, y)
                total += loss.double() * len(x)
                count += len(x)
        finally:
            self.model.train()
        return total.item(), count

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the single-device model's names."""
        return named_parameters(self.model)

    def blocks(self) -> dict[int, nn.Module]:
        """This rank's transformer blocks by global layer index."""
        return dict(enumerate(self.model.blocks))

    def gathered(self, params: list[nn.Parameter]) -> contextlib.AbstractContextManager:
        """Context in which ``params`` hold their full data-parallel values (ZeRO-3 partitions them)."""
        return contextlib.nullcontext()

    def state_pieces(self) -> list[Piece]:
        """This rank's pieces of every parameter and, once the optimizer has taken a step, of its Adam moments (see
        :class:`Piece`); local, no communication."""
        raise NotImplementedError

    def prepare_state_load(self, adam_step: int) -> list[Piece]:
        """The pieces to read a checkpoint into: the parameters', and with ``adam_step`` > 0 the Adam moments' (the
        optimizer state is created first, at that step count). Then :meth:`finish_state_load`."""
        raise NotImplementedError

    def finish_state_load(self) -> None:
        """After the pieces were filled: bring whatever mirrors them up to date (ZeRO's FP32 master partitions)."""

    def adam_step(self) -> int:
        """Number of updates the optimizer has applied."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the engine holds (hooks, communication buffers) before the process groups go."""


class LocalEngine(Engine):
    """Single process, or DDP over the data-parallel group; torch AdamW."""

    def __init__(self, model: nn.Module, config: Config, dims: ParallelDims):
        self.model, self.dims, self.config = model, dims, config
        self.optimizer = build_optimizer(model, config, dims.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.ddp = dims.dp > 1
        wrapped = model
        if self.ddp:
            device_ids = [dims.device.index] if dims.device.type == "cuda" else None
            # buckets are all-reduced as they fill during the backward (parallel.ddp_bucket_mb)
            wrapped = nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=dims.dp_group,
                                                          bucket_cap_mb=config.parallel.ddp_bucket_mb)
        self.wrapped = torch.compile(wrapped) if config.run.compile else wrapped

    def describe(self) -> str:
        return "DDP" if self.ddp else "single replica"

    def forward_backward(self, micro_batches, autocast):
        loss_sum = torch.zeros((), device=self.dims.device)
        n = len(micro_batches)
        for i, (x, y, *row_keys) in enumerate(micro_batches):
            # DDP all-reduces gradients on the last micro-batch only
            sync = i == n - 1 or not self.ddp
            with contextlib.nullcontext() if sync else self.wrapped.no_sync():
                with autocast():
                    _, loss = self.wrapped(x, y, *row_keys)
                (loss / n).backward()
            loss_sum += loss.detach()
        return loss_sum / n

    def step(self, lr, veto):
        norm = tensor_parallel_grad_norm(self.params, self.dims)
        problem = veto(norm.item())
        if problem is None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            clip = self.config.optim.grad_clip
            if clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item(), problem

    def state_pieces(self):
        pieces = []
        for name, p in self.named_parameters():
            shape = tuple(p.shape)
            pieces.append(Piece(name, PARAM, p, shape, 0, p.detach()))
            state = self.optimizer.state.get(p)
            if state:
                pieces += [Piece(name, k, p, shape, 0, state[k]) for k in ADAM_STATE_KEYS]
        return pieces

    def adam_step(self) -> int:
        steps = [int(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return max(steps, default=0)

    def prepare_state_load(self, adam_step):
        if adam_step:  # torch's AdamW state, as its first step creates it (the step count where that variant keeps it)
            for group in self.optimizer.param_groups:
                on_device = group.get("fused") or group.get("capturable")
                for p in group["params"]:
                    step = torch.tensor(float(adam_step), dtype=torch.float32, device=p.device if on_device else "cpu")
                    zeros = {k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in ADAM_STATE_KEYS}
                    self.optimizer.state[p] = {"step": step, **zeros}
        return self.state_pieces()


def import_deepspeed():
    """DeepSpeed, imported for an engine. On a CPU, DeepSpeed's communication backend JIT-compiles a shared-memory
    all-reduce op when it starts (about 50 s on two cores, once per machine and DeepSpeed install) that only its
    inference path calls (``inference_all_reduce``); training reduces through torch.distributed. The op is marked
    unavailable first, so the backend starts without building it (on a GPU there is no such op to skip)."""
    import deepspeed
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False
    return deepspeed


class ZeroEngine(Engine):
    """DeepSpeed ZeRO (stage 1: optimizer state, 2: + gradients, 3: + parameters sharded over data parallel).

    Besides DeepSpeed's public API (initialize, backward, step, GatheredParameters, zero.Init, refresh_fp32_params,
    the safe_get_local_* accessors) it uses a few attributes of the ZeRO optimizer and its parameters: the inner torch
    optimizer and the global norm stashed before it runs (the guard's veto), the flat FP32 partitions and the
    fragment links to Adam's moments (checkpoints: a parameter's ``_hp_mapping`` with its fragment's address, a
    ZeRO-3 parameter's ``ds_tensor`` partition and process group). deepspeed is pinned (pyproject.toml), and
    tests/distributed fails if any of these changes meaning."""

    def __init__(self, model: nn.Module, config: Config, dims: ParallelDims, run_dir: Optional[Path] = None):
        self.model, self.dims, self.config = model, dims, config
        self.zero_stage = config.parallel.zero_stage
        self._start_deepspeed(deepspeed_config(config, dims, self.zero_stage), run_dir,
                              mpu=dims if dims.distributed else None)
        self.forward = torch.compile(self.ds) if config.run.compile else self.ds

    def _start_deepspeed(self, ds_config: dict, run_dir: Optional[Path], mpu) -> None:
        """deepspeed.initialize around ``self.model`` with the recipe's AdamW; the JSON config goes to the run folder."""
        deepspeed = import_deepspeed()

        if run_dir is not None and self.dims.is_logging_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        optimizer = build_optimizer(self.model, self.config, self.dims.device)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=optimizer, config=ds_config,
                                                             mpu=mpu, dist_init_required=False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._linked_at_step = -1

    def describe(self) -> str:
        return f"DeepSpeed ZeRO-{self.zero_stage}"

    def close(self) -> None:
        self.ds.destroy()

    def forward_backward(self, micro_batches, autocast):
        loss_sum = torch.zeros((), device=self.dims.device)
        for i, (x, y, *row_keys) in enumerate(micro_batches):
            with autocast():
                _, loss = self.forward(x, y, *row_keys)
            self.ds.backward(loss)  # DeepSpeed divides by the accumulation steps and reduces at the last one
            loss_sum += loss.detach()
            if i < len(micro_batches) - 1:
                # DeepSpeed counts micro-batches in step(): before the last one it only advances the count, so that
                # the last backward is the accumulation boundary; the boundary's step() is self.step()
                self.ds.step()
        return loss_sum / len(micro_batches)

    def step(self, lr, veto):
        return self._vetoed_step(lr, veto, self.ds.step)

    def _vetoed_step(self, lr: float, veto: Callable[[float], Optional[str]],
                     run: Callable[[], object]) -> tuple[float, Optional[str]]:
        """``run()`` (DeepSpeed's step, or a whole pipeline batch) at learning rate ``lr``, its updates subject to
        ``veto``; returns (the global gradient norm, the objection or None)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        decision: dict[str, Optional[str]] = {}
        with self._vetoed_updates(veto, decision):
            run()
        norm = float(self.ds.get_global_grad_norm())
        if "problem" not in decision:  # dropped by DeepSpeed: a NaN/inf gradient norm
            decision["problem"] = veto(norm)
        return norm, decision["problem"]

    @contextlib.contextmanager
    def _vetoed_updates(self, veto: Callable[[float], Optional[str]], decision: dict):
        """Within this context, DeepSpeed's optimizer steps ask ``veto(global gradient norm)`` first.

        DeepSpeed's step computes the global gradient norm (over its partitions, all-reduced over data, tensor and
        pipeline parallel), clips, then calls the inner torch optimizer once per partition group. The veto is asked
        at the first of those calls, when the norm is known and nothing has been updated yet; its answer (kept in
        ``decision["problem"]``) holds for every group, so on an objection nothing is updated (the unchanged
        partitions are gathered back into the parameters as usual). A step whose norm is not finite never reaches
        the inner optimizer: DeepSpeed drops it itself (its fp16-overflow path) and ``decision`` stays empty, so that
        the caller can still ask the veto about that norm afterwards, to count and report it."""
        inner = self._inner()
        update = inner.step

        def guarded_update(*args, **kwargs):
            if "problem" not in decision:
                decision["problem"] = veto(float(self.optimizer._global_grad_norm))
            return update(*args, **kwargs) if decision["problem"] is None else None

        inner.step = guarded_update
        try:
            yield
        finally:
            del inner.step  # back to the class's method

    def gathered(self, params):
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)

    def state_pieces(self):
        step = self.adam_step()
        if step and self._linked_at_step != step:
            self._link_moments()
            self._linked_at_step = step
        return self._pieces(moments=step > 0, for_saving=True)

    def _pieces(self, moments: bool, for_saving: bool) -> list[Piece]:
        """Parameters: the model's own tensors under ZeRO-1/2 (each rank holds them whole; DCP writes each once),
        this rank's partition under ZeRO-3. Moments: this rank's fragment of each parameter in its flat partition.
        Under ZeRO-3 DeepSpeed keeps the FP32 master values in a copy of the partitions; with FP32 parameters (the
        recipe's) the two are equal, and :meth:`finish_state_load` copies the parameters into it."""
        from deepspeed.utils import safe_get_local_optimizer_state

        pieces = []
        skip_moments = self._moments_saved_elsewhere() if for_saving else set()
        for name, p in self.named_parameters():
            if self.zero_stage == 3:
                shape, size = tuple(p.ds_shape), p.ds_tensor.numel()
                start = dist.get_rank(group=p.ds_process_group) * size
                held = max(0, min(size, p.ds_numel - start))  # the last partition is padded
                pieces.append(Piece(name, PARAM, p, shape, start, p.ds_tensor.narrow(0, 0, held)))
                if moments:
                    pieces += [Piece(name, k, p, shape, start, safe_get_local_optimizer_state(p, k).narrow(0, 0, held))
                               for k in ADAM_STATE_KEYS]
                continue
            shape = tuple(p.shape)
            pieces.append(Piece(name, PARAM, p, shape, 0, p.detach()))
            mapping = getattr(p, "_hp_mapping", None)  # None: no fragment of p in this rank's partition
            if moments and mapping is not None and id(p) not in skip_moments:
                start = mapping.lp_fragment_address.start
                pieces += [Piece(name, k, p, shape, start, mapping.get_optim_state_fragment(k))
                           for k in ADAM_STATE_KEYS]
        return pieces

    def _moments_saved_elsewhere(self) -> set[int]:
        """Parameters whose moments another rank saves in full (the pipeline's tied weight, saved by its first
        stage: its copy on a later stage is cut into other fragments)."""
        return set()

    def prepare_state_load(self, adam_step):
        if adam_step:
            self._create_moments(adam_step)
        return self._pieces(moments=adam_step > 0, for_saving=False)

    def finish_state_load(self):
        self.optimizer.refresh_fp32_params()  # the FP32 master partitions from the loaded parameters

    def _link_moments(self) -> None:
        """Point every parameter's fragment mapping at the current Adam moments of its flat partition (stages 1, 2).

        DeepSpeed (0.19) links them once, right after the first parameter group's first update, before the moments
        of the other groups exist; parameters of those groups would then have no moments to read or write."""
        if self.zero_stage in (1, 2):
            self.optimizer._hp_optimizer_states_linked = False
            self.optimizer._lazy_init_hp_params_optimizer_state()

    def _inner(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer  # the torch AdamW that updates the flat FP32 partitions

    def adam_step(self) -> int:
        steps = [int(s["step"]) for s in self._inner().state.values() if "step" in s]
        return max(steps, default=0)

    def _create_moments(self, adam_step: int) -> None:
        """The flat FP32 partitions get their Adam state lazily at the first update. Create it as torch's AdamW does
        (zero moments; the step count on the device only for the fused/capturable variants) and link every
        parameter's fragments to it, so that the checkpoint is read straight into the partitions."""
        inner = self._inner()
        on_device = bool(inner.defaults.get("fused") or inner.defaults.get("capturable"))
        flats = self.optimizer.fp32_partitioned_groups_flat if self.zero_stage == 3 \
            else self.optimizer.single_partition_of_fp32_groups
        for flat in flats:
            step = torch.tensor(float(adam_step), dtype=torch.float32, device=flat.device if on_device else "cpu")
            inner.state[flat] = {"step": step, **{k: torch.zeros_like(flat) for k in ADAM_STATE_KEYS}}
        self._link_moments()
        self._linked_at_step = adam_step


def partition_zero3(module: nn.Module, config: Config, dims: ParallelDims) -> None:
    """Partition the parameters of ``module`` over data parallel as DeepSpeed's ZeRO-3 engine does when it starts
    (the same ``zero.Init(module=...)`` call, with the engine's arguments), so that the engine, finding them
    partitioned, leaves them be. launcher/parallelize.py calls it one block at a time, right after materialising
    the block, so that no rank holds more than one block's (tensor-parallel slice of) weights whole. Collective over
    the data-parallel group."""
    deepspeed = import_deepspeed()

    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    deepspeed.zero.Init(module=module, data_parallel_group=dims.dp_group, dtype=torch.float32,
                        config_dict_or_path=deepspeed_config(config, dims, 3), mpu=dims)


def deepspeed_config(config: Config, dims: ParallelDims, zero_stage: int) -> dict:
    """DeepSpeed's JSON config, derived from the typed config (written to the run folder for reference)."""
    data = config.data
    accumulation = data.global_batch_size // (data.micro_batch_size * dims.dp)
    return {
        "train_batch_size": data.global_batch_size,
        "train_micro_batch_size_per_gpu": data.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": config.optim.grad_clip,
        # No "bf16"/"fp16" section: FP32 parameters, gradients and optimizer state (see the module docstring). The
        # engine's forward runs in torch autocast only if this section enables it (it disables an outer one).
        "torch_autocast": {"enabled": autocast_dtype(config, dims.device) == "bf16", "dtype": "bfloat16",
                           "lower_precision_safe_modules": []},
        "zero_optimization": zero_optimization(config, zero_stage),
        "steps_per_print": 2**31 - 1,  # the trainer prints progress
        "wall_clock_breakdown": False,
    }


def zero_optimization(config: Config, zero_stage: int) -> dict:
    """DeepSpeed's zero_optimization section: the stage and the overlap settings of ParallelConfig (whose defaults
    are DeepSpeed's own; overlap_comm is left out when null, so that DeepSpeed picks it by stage)."""
    p = config.parallel
    section = {"stage": zero_stage, "contiguous_gradients": p.zero_contiguous_gradients,
               "reduce_bucket_size": p.zero_reduce_bucket_size, "allgather_bucket_size": p.zero_allgather_bucket_size}
    if zero_stage == 3:
        section["stage3_prefetch_bucket_size"] = p.zero_prefetch_bucket_size
    if p.zero_overlap_comm is not None:
        section["overlap_comm"] = p.zero_overlap_comm
    return section
