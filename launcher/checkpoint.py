"""Checkpoints that outlive interruption and layout.

A checkpoint holds full (unsplit) FP32 tensors under the single-device model's parameter names, whatever layout wrote
it: the parameters, Adam's two moments per parameter with the optimizer's step count, and the FP8 FFNs' delayed-scaling
state (scales and amax histories by module name; launcher/fp8.py). Writing assembles each
parameter from its ZeRO partitions (data parallel) and tensor-parallel slices, one parameter at a time, on the
logging rank; loading gives every rank its slice of each tensor. So a run saved with TP2 x DP2 under ZeRO-2 resumes
with one process, and the reverse, with the same optimizer state (tests/distributed).

Files: ``<run_dir>/checkpoints/step_XXXXXXXX.pt``, each beside a ``.sha256`` file holding its size and checksum.
A checkpoint is written under a temporary name and flushed to disk, its checksum file is written and flushed, and
only then is it renamed into place (and the folder flushed), so a crash or power loss mid-save leaves the previous
checkpoint intact. On resume the newest checkpoint is verified against its checksum; a damaged one (truncated, torn,
altered, unfinished) is named in one line and the newest intact one is used instead (:class:`CheckpointStore`). The
two newest intact checkpoints are kept. A bad (non-finite) state is never saved: the trainer saves only after a
step that its guard accepted or dropped.

A consolidated file is the simple choice at this project's sizes (a 1.3B model with Adam state is ~16 GB, written by
one process); beyond that, torch.distributed.checkpoint would let every rank write its own slices.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import BinaryIO, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from launcher.config import ConfigError, PrecisionConfig
from launcher.fp8 import load_scaling_state, scaling_state
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import ADAM_STATE_KEYS, Engine
from launcher.parallel.names import named_parameters
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


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the file and says what to do."""


class HashingWriter:
    """File object for torch.save that hashes the bytes as they are written (no second read of a large file)."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _step_of(path: Path) -> Optional[int]:
    match = re.match(r"step_(\d+)\.", path.name)
    return int(match.group(1)) if match else None


class CheckpointStore:
    """Checkpoints of one arm: ``<run_dir>/checkpoints/step_XXXXXXXX.pt``, each with ``step_XXXXXXXX.pt.sha256``
    (its size and SHA-256, JSON) written before the checkpoint gets its final name.

    So a step file without its checksum file, or one whose size or checksum differs from it, is damaged (a torn
    write, a full disk, a half-copied folder, a bad block). On resume :meth:`resumable` verifies the newest checkpoint
    and falls back to the newest intact one; the damaged ones are renamed ``*.damaged`` so that they never shadow a
    good one again and stay for inspection until pruning passes them.

    ``writer`` wraps the open temporary file for torch.save (a test passes one that pauses mid-write, so that a
    fault test can kill the process inside a save: tests/paused_save_worker.py)."""

    def __init__(self, run_dir: Path, writer: Callable[[BinaryIO], HashingWriter] = HashingWriter):
        self.dir = run_dir / "checkpoints"
        self.writer = writer

    def steps(self) -> list[Path]:
        """Every checkpoint file, oldest first (intact or not)."""
        return sorted(self.dir.glob("step_*.pt"))

    def newest_file(self) -> Optional[Path]:
        """The newest checkpoint file of any state, damaged ones included: the trace of an earlier run."""
        files = [*self.dir.glob("step_*.pt"), *self.dir.glob("step_*.pt.damaged")]
        return max(files, key=lambda p: (_step_of(p), p.name)) if files else None

    @staticmethod
    def _sum_file(path: Path) -> Path:
        return path.with_name(path.name + ".sha256")

    def _recorded(self, path: Path) -> tuple[Optional[dict], Optional[str]]:
        """(the checksum record of ``path``, None) or (None, why it is unusable)."""
        try:
            record = json.loads(self._sum_file(path).read_text())
            return {"bytes": int(record["bytes"]), "sha256": str(record["sha256"])}, None
        except FileNotFoundError:
            return None, "no checksum file: its save never finished"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return None, f"its checksum file is unreadable ({type(err).__name__})"

    def _size_problem(self, path: Path, record: dict) -> Optional[str]:
        size = path.stat().st_size
        if size != record["bytes"]:
            return f"{'empty' if size == 0 else 'truncated' if size < record['bytes'] else 'too long'}: " \
                   f"{size} of {record['bytes']} bytes"
        return None

    def problem(self, path: Path) -> Optional[str]:
        """None if ``path`` is intact (size and SHA-256 as recorded at save time), else what is wrong, in words.
        Reads the whole file once (~10 s for a 16 GB checkpoint)."""
        record, why = self._recorded(path)
        if record is None:
            return why
        try:
            problem = self._size_problem(path, record)
            if problem:
                return problem
            sha = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    sha.update(chunk)
        except OSError as err:
            return f"unreadable ({err.strerror or err})"
        return None if sha.hexdigest() == record["sha256"] else "checksum mismatch: its contents changed after saving"

    def _looks_complete(self, path: Path) -> bool:
        """Checksum file present and size as recorded (the contents are not read; :meth:`problem` does that)."""
        record, _ = self._recorded(path)
        return record is not None and self._size_problem(path, record) is None

    def latest(self) -> Optional[Path]:
        """The newest checkpoint that looks complete, without reading it; :meth:`resumable` verifies contents."""
        return next((path for path in reversed(self.steps()) if self._looks_complete(path)), None)

    def resumable(self) -> tuple[Optional[Path], Optional[str]]:
        """(newest intact checkpoint or None, a one-line message naming the damaged newer ones or None). Damaged
        checkpoints newer than the chosen one are renamed ``<name>.damaged``. Raises CheckpointError if there are
        checkpoints and none is intact (the caller must not start over on top of them)."""
        damaged = []
        for path in reversed(self.steps()):
            problem = self.problem(path)
            if problem is None:
                break
            damaged.append((path, problem))
        else:
            path = None
        for bad, _ in damaged:
            bad.replace(bad.with_name(bad.name + ".damaged"))
        if not damaged:
            return path, None
        named = "; ".join(f"{bad} is damaged ({problem})" for bad, problem in damaged)
        if path is None:
            raise CheckpointError(f"no intact checkpoint to resume: {named}; renamed to *.damaged; set "
                                  "checkpoint.resume=false run.overwrite=true to start over")
        return path, f"{named}; renamed to *.damaged, resuming from {path.name}"

    def save(self, step: int, state: dict) -> Path:
        """Write to a temporary name, flush it, record its size and checksum (flushed), then rename it into place
        and flush the folder: a crash at any point leaves every earlier checkpoint intact and at most one file that
        :meth:`problem` rejects."""
        path = self.dir / f"step_{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        sum_tmp = self.dir / (self._sum_file(path).name + ".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                writer = self.writer(f)
                torch.save(state, writer)
                f.flush()
                os.fsync(f.fileno())
            sum_tmp.write_text(json.dumps({"bytes": writer.size, "sha256": writer.sha.hexdigest()}) + "\n")
            _fsync_path(sum_tmp)
            sum_tmp.replace(self._sum_file(path))
            tmp.replace(path)
            _fsync_path(self.dir)
        except OSError as err:  # a full disk or a lost mount: stop with one line; nothing earlier was touched
            for partial in (tmp, sum_tmp):
                partial.unlink(missing_ok=True)
            raise CheckpointError(f"could not write checkpoint {path} ({err.strerror or err}); the previous "
                                  "checkpoints are intact: fix the cause (e.g. free disk space) and rerun the same "
                                  "command to resume") from None
        self._prune()
        return path

    def _prune(self) -> None:
        """Keep the KEEP newest intact-looking checkpoints; delete everything of an older step (checkpoints, their
        checksum files, damaged and temporary files). So the newest good checkpoint is never deleted."""
        kept = [p for p in self.steps() if self._looks_complete(p)]
        if not kept:
            return
        oldest_kept = _step_of(kept[-KEEP:][0])
        for path in self.dir.glob("step_*"):
            step = _step_of(path)
            if step is not None and step < oldest_kept:
                path.unlink()

    def keep(self, step: int, label: str) -> Path:
        """Keep step ``step``'s checkpoint outside the two-kept rotation as ``<label>_step_XXXXXXXX.pt`` (with its
        checksum file; hard links where the file system allows, else copies). Pruning never touches these;
        launcher.probe_checkpoint reads them like any checkpoint."""
        source = self.dir / f"step_{step:08d}.pt"
        kept = self.dir / f"{label}_{source.name}"
        for src, dst in ((self._sum_file(source), self._sum_file(kept)), (source, kept)):
            dst.unlink(missing_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        return kept

    def load(self, path: Path) -> dict:
        # mmap: each rank reads only the slices it copies out, not the whole file into memory.
        # weights_only=False: the state holds python/numpy RNG states, which are not plain tensors.
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        except Exception as err:  # any failure to unpickle is a damaged file to the user, never a traceback
            said = str(err).split(". ")[0].splitlines()[0] if str(err).strip() else "no details"
            raise CheckpointError(f"checkpoint {path} cannot be read ({type(err).__name__}: {said}); move it away "
                                  "to resume from the one before, or set checkpoint.resume=false run.overwrite=true"
                                  ) from None
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            fmt = state.get("format", 1) if isinstance(state, dict) else "unknown"
            raise ConfigError(f"checkpoint {path} was written by an older version of this recipe (format "
                              f"{fmt}, this version reads {FORMAT}); start a new run.experiment or "
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
    """Copy every saved parameter into ``model`` before launcher/parallelize.py splits it (this rank's slice, if it is
    split already)."""
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
