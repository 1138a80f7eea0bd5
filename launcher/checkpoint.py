"""Checkpoints that outlive interruption and layout.

A checkpoint holds full (unsplit) FP32 tensors under the single-device model's parameter names, whatever layout wrote
it: the parameters, Adam's two moments per parameter with the optimizer's step count, and the FP8 FFNs' delayed-scaling
state (scales and amax histories by module name; launcher/fp8.py). Writing assembles each
parameter from its ZeRO partitions (data parallel) and tensor-parallel slices, one parameter at a time, on the
logging rank; loading gives every rank its slice of each tensor. So a run saved with TP2 x DP2 under ZeRO-2 resumes
with one process, and the reverse, with the same optimizer state (tests/distributed).

Files: ``<run_dir>/checkpoints/step_XXXXXXXX.pt`` and a ``latest`` file naming the newest. A checkpoint is written
under a temporary name, flushed to disk (file and folder), then renamed; the ``latest`` pointer moves last, so a crash
mid-save leaves the previous checkpoint intact. The two newest are kept. A bad (non-finite) state is never saved: the
trainer saves only after a step that its guard accepted or dropped.

A consolidated file is the simple choice at this project's sizes (a 1.3B model with Adam state is ~16 GB, written by
one process); beyond that, torch.distributed.checkpoint would let every rank write its own slices.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from launcher.config import ConfigError, PrecisionConfig
from launcher.fp8 import load_scaling_state, scaling_state
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import ADAM_STATE_KEYS, Engine, named_parameters
from launcher.parallel.tensor import gather_full, shard_of

KEEP = 2  # checkpoints kept per arm: the newest and one before it
FORMAT = 2  # 1: state_dicts of one process (before layouts existed); 2: full tensors by parameter name


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointStore:
    """Checkpoints of one arm in <run_dir>/checkpoints/step_XXXXXXXX.pt plus a 'latest' file naming the newest."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "checkpoints"

    def latest(self) -> Optional[Path]:
        pointer = self.dir / "latest"
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if path.is_file() else None

    def save(self, step: int, state: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        _fsync_path(tmp)
        tmp.replace(path)
        pointer_tmp = self.dir / "latest.tmp"
        pointer_tmp.write_text(path.name)
        _fsync_path(pointer_tmp)
        pointer_tmp.replace(self.dir / "latest")
        _fsync_path(self.dir)
        for old in sorted(self.dir.glob("step_*.pt"))[:-KEEP]:
            old.unlink()
        return path

    def load(self, path: Path) -> dict:
        # mmap: each rank reads only the slices it copies out, not the whole file into memory.
        # weights_only=False: the state holds python/numpy RNG states, which are not plain tensors.
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        if state.get("format") != FORMAT:
            raise ConfigError(f"checkpoint {path} was written by an older version of this recipe (format "
                              f"{state.get('format', 1)}, this version reads {FORMAT}); start a new run.experiment or "
                              "set checkpoint.resume=false")
        return state


def gather_training_state(engine: Engine, dims: ParallelDims) -> Optional[dict]:
    """Parameters and Adam moments as full tensors on the logging rank (None elsewhere). Collective: every rank calls.

    One parameter at a time: its data-parallel partitions are assembled by the engine, then its tensor-parallel
    slices are gathered; the first rank of each pipeline stage keeps the result (on the CPU), and the stages send
    theirs to the logging rank (a weight tied across stages comes from the first stage that holds it)."""
    stage_leader = dims.dp_rank == 0 and dims.tp_rank == 0
    adam_step = engine.adam_step()
    params, moments = {}, {}
    for name, param in engine.named_parameters():
        shard = shard_of(param)
        full = gather_full(engine.full_parameter(param).float(), shard, dims)
        if stage_leader:
            params[name] = full.cpu()
        state = engine.full_optimizer_state(param) if adam_step else None
        if state is not None:
            full_state = {k: gather_full(state[k].float(), shard, dims) for k in ADAM_STATE_KEYS}
            if stage_leader:
                moments[name] = {k: v.cpu() for k, v in full_state.items()}
    if not stage_leader:
        return None
    # FP8 delayed-scaling state: the same on every rank of a stage (reduced over its amax group)
    fp8 = scaling_state(engine.blocks())
    if dims.pp > 1:  # the stage leaders form one pipeline group, with the logging rank first
        stages = [None] * dims.pp if dims.is_logging_rank else None
        dist.gather_object((params, moments, fp8), stages, dst=dist.get_global_rank(dims.pp_group, 0),
                           group=dims.pp_group)
        if not dims.is_logging_rank:
            return None
        params, moments, fp8 = {}, {}, {}
        for stage_params, stage_moments, stage_fp8 in stages:
            params.update({k: v for k, v in stage_params.items() if k not in params})
            moments.update({k: v for k, v in stage_moments.items() if k not in moments})
            fp8.update(stage_fp8)
    return {"format": FORMAT, "model": params, "optimizer": {"adam_step": adam_step, "state": moments},
            "fp8_scaling": fp8}


def _local(full: torch.Tensor, param: nn.Parameter, dims: ParallelDims) -> torch.Tensor:
    shard = shard_of(param)
    return full if shard is None else shard.slice(full, dims.tp_rank)


def check_fits(state: dict, model: nn.Module, dims: ParallelDims, path: Path) -> None:
    """Raise ConfigError naming the first tensor whose shape differs between the checkpoint and this model."""
    saved = state["model"]
    for name, param in named_parameters(model):
        if name not in saved:
            raise ConfigError(f"checkpoint {path} has no tensor {name}: it was written for another model; use "
                              "another run.experiment or checkpoint.resume=false")
        shard = shard_of(param)
        expected = list(param.shape)
        if shard is not None:
            expected[shard.dim] *= shard.parts
        if list(saved[name].shape) != expected:
            hint = ""
            if name == "tok_emb.weight" and saved[name].shape[1:] == torch.Size(expected[1:]):
                hint = f" (vocabulary {saved[name].shape[0]} there, {expected[0]} here)"
            raise ConfigError(f"checkpoint {path} does not fit this configuration: {name} is "
                              f"{tuple(saved[name].shape)} there and {tuple(expected)} here{hint}; use another "
                              "run.experiment or checkpoint.resume=false")


@torch.no_grad()
def load_parameters(model: nn.Module, state: dict, dims: ParallelDims) -> None:
    """Copy this rank's slice of every saved parameter into the (not yet engine-wrapped) model."""
    for name, param in named_parameters(model):
        param.copy_(_local(state["model"][name], param, dims))


def load_optimizer_state(engine: Engine, state: dict, dims: ParallelDims) -> None:
    """Install the saved Adam moments (this rank's slices) and step count into the engine's optimizer."""
    optim = state["optimizer"]
    if not optim["adam_step"]:
        return  # saved before the first applied update: the optimizer starts fresh, as it did then
    states = {name: {k: _local(optim["state"][name][k], p, dims) for k in ADAM_STATE_KEYS}
              for name, p in engine.named_parameters()}
    engine.load_optimizer_state(states, optim["adam_step"])


def load_fp8_scaling(engine: Engine, state: dict, precision: PrecisionConfig) -> None:
    """Install the saved FP8 delayed-scaling state into this rank's FP8 FFNs (none saved: they start fresh, as a new
    run does; e.g. a checkpoint written with BF16 FFNs)."""
    if precision.fp8_ffn and state.get("fp8_scaling"):
        load_scaling_state(engine.blocks(), state["fp8_scaling"], precision)
