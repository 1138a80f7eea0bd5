"""Checkpoints that outlive interruption and layout, written and read in shards by every rank.

A checkpoint is a folder, ``<run_dir>/checkpoints/step_XXXXXXXX/``, written through torch.distributed.checkpoint
(DCP; launcher/sharded.py): every rank writes only what it holds into its own files (``__<rank>_<i>.distcp``, at
most FILE_BYTES each) and reads
only what it needs, in parallel; no rank ever assembles a whole parameter or optimizer state. Entries are named and
shaped as in the single-device model, whatever layout wrote them:

- ``model/<name>``, ``optim/exp_avg/<name>``, ``optim/exp_avg_sq/<name>``: FP32 parameters and Adam moments, in the
  chunks their writers held (tensor-parallel slices, ZeRO partitions cut into rectangles, whole tensors);
- ``run``: step, Adam's step count, guard state, layout, configuration (written by the logging rank);
- ``rng/<rank>``: each rank's random-generator states; ``fp8/<module>``: FP8 delayed-scaling state, one copy per
  module (launcher/fp8.py); ``monitors/...``: monitor state (launcher/monitors/monitors.py), per-head tensors in
  per-head chunks.

DCP's ``.metadata`` file lists every chunk with its global offsets, so a checkpoint written under one layout is read
under any other (TP, PP, DP, ZeRO stage, SP): each rank asks for its own chunks and DCP reads the overlapping parts
of the saved ones (tests/distributed).

Integrity and atomicity: the folder is written as ``step_XXXXXXXX.tmp/``; each rank's file is hashed while it is
written (SHA-256) and flushed to disk (fsync); once every rank is done, the logging rank writes ``checksums.json``
(size and SHA-256 of every file), flushes it and the folder, renames the folder into place and flushes its parent.
A crash at any point leaves the earlier checkpoints intact and at most a ``.tmp`` folder, which is never resumed. On
resume the newest checkpoint is verified, its files shared out among the ranks (each file read and hashed by one
rank); a damaged one is named in one line, renamed ``*.damaged``, and the newest intact one is used instead
(:class:`CheckpointStore`). The two newest intact checkpoints are kept. A bad (non-finite) state is never saved: the
trainer saves only after a step that its guard accepted or dropped.

Checkpoints of earlier versions (one ``step_XXXXXXXX.pt`` file of whole tensors, format 2) are refused with the
command that converts them: ``python -m launcher.checkpoint convert RUN_DIR`` (one process; it holds the old file's
tensors, memory-mapped, while it writes them).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import queue
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem

from launcher import sharded
from launcher.config import ConfigError, PrecisionConfig
from launcher.fp8 import load_scaling_state, scaling_state
from launcher.parallel.dims import ParallelDims
from launcher.parallel.engine import ADAM_STATE_KEYS, PARAM, Engine, Piece
from launcher.parallel.materialize import full_shape
from launcher.parallel.names import named_parameters
from launcher.parallel.tensor import shard_of
from launcher.sharded import Sharded, flat_range_chunks

KEEP = 2  # checkpoints kept per arm: the newest and one before it
FORMAT = 3  # 1: state_dicts of one process; 2: one file of whole tensors by name; 3: a folder of shards (DCP)
RUN = "run"  # the entry of the run's own state (step, guard, layout, configuration)
CHECKSUMS = "checksums.json"


def entry(key: str, name: str) -> str:
    """The checkpoint entry of a parameter (``key`` PARAM) or of one of its Adam moments."""
    return f"model/{name}" if key == PARAM else f"optim/{key}/{name}"


def rng_entry(rank: int) -> str:
    return f"rng/{rank}"


def fp8_entry(module: str) -> str:
    return f"fp8/{module}"


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
    """A checkpoint that cannot be used or written; the message names it and says what to do."""


class HashingWriter:
    """A file being written, hashing the bytes as they pass (no second read of a large file)."""

    def __init__(self, f: BinaryIO):
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:  # DCP records where each item starts; the file is only ever appended to
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()


FILE_BYTES = 256 * 2**20
"""Each rank writes its shards into files of about this size at most (a larger chunk gets a file of its own)."""


class _BoundedFilesWriter(FileSystemWriter):
    """DCP's file writer, with each rank's chunks spread over files of at most FILE_BYTES, written one after the
    other. DCP copies every chunk that is a view of a larger buffer (a ZeRO partition, a cut of a tensor-parallel
    slice) and keeps the copies until their file is complete: bounded files bound the memory a save takes (tested:
    tests/distributed/test_sharded_checkpoints.py)."""

    def write_data(self, plan, planner):
        files: queue.Queue = queue.Queue()
        bucket: list = []
        size = 0

        def close_bucket():
            name = f"{plan.storage_data.prefix}{files.qsize()}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))

        for item in plan.items:
            data = item.tensor_data  # (DCP's own tensor_storage_size is the whole tensor's, not the chunk's)
            item_bytes = 0 if data is None else math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
            if bucket and size + item_bytes > FILE_BYTES:
                close_bucket()
                bucket, size = [], 0
            bucket.append(item)
            size += item_bytes
        close_bucket()  # the last one, empty or not (a rank with nothing to write still has its file)
        return self._write_data(planner, files)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, with every shard file written through ``writer`` (a :class:`HashingWriter`);
    ``written`` then holds each file's size and SHA-256."""

    def __init__(self, writer: Callable[[BinaryIO], HashingWriter]):
        super().__init__()
        self.writer = writer
        self.written: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        with open(path, mode) as f:
            stream = self.writer(f)
            yield stream  # DCP writes, flushes (fsync) and closes it
        self.written[path.name] = {"bytes": stream.size, "sha256": stream.sha.hexdigest()}


def _step_of(path: Path) -> Optional[int]:
    match = re.match(r"step_(\d+)", path.name)
    return int(match.group(1)) if match else None


def _file_problem(path: Path, record: dict) -> Optional[str]:
    """None if the file ``path`` has the recorded size and SHA-256, else what is wrong."""
    try:
        size = path.stat().st_size
        if size != record["bytes"]:
            how = "empty" if size == 0 else "truncated" if size < record["bytes"] else "too long"
            return f"{how}: {path.name} has {size} of {record['bytes']} bytes"
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                sha.update(chunk)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as err:
        return f"{path.name} is unreadable ({err.strerror or err})"
    return None if sha.hexdigest() == record["sha256"] else \
        f"checksum mismatch: {path.name} changed after saving"


def _one_line(err: BaseException) -> str:
    """The cause of a failed DCP save or load in words: the first rank's error (its OS error if there is one)."""
    errors = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    first = next((e for e in errors if isinstance(e, OSError)), errors[0])
    if isinstance(first, OSError) and first.strerror:
        return first.strerror
    said = str(first).strip().splitlines()
    return f"{type(first).__name__}: {said[0] if said else 'no details'}"


class CheckpointStore:
    """Checkpoints of one arm: ``<run_dir>/checkpoints/step_XXXXXXXX/`` folders (module docstring), each with its
    ``checksums.json`` written last, before the folder gets its final name.

    So a folder without its checksum file, or with a file whose size or checksum differs from it, is damaged (a
    torn write, a full disk, a half-copied folder, a bad block). :meth:`resumable` verifies the newest checkpoint and
    falls back to the newest intact one; the damaged ones are renamed ``*.damaged`` so that they never shadow a good
    one again and stay for inspection until pruning passes them.

    ``writer`` wraps each open shard file (a test passes one that pauses mid-write, so that a fault test can kill the
    process inside a save: tests/paused_save_worker.py). Methods that take ``dims`` are collective: every rank calls
    them (``dims`` None: one process)."""

    def __init__(self, run_dir: Path, writer: Callable[[BinaryIO], HashingWriter] = HashingWriter):
        self.dir = run_dir / "checkpoints"
        self.writer = writer

    @staticmethod
    def name(step: int) -> str:
        return f"step_{step:08d}"

    def steps(self) -> list[Path]:
        """Every checkpoint folder, oldest first (intact or not)."""
        return sorted(p for p in self.dir.glob("step_*") if p.is_dir() and re.fullmatch(r"step_\d+", p.name))

    def legacy(self) -> list[Path]:
        """Single-file checkpoints of earlier versions (format 2), oldest first."""
        return sorted(self.dir.glob("step_*.pt"))

    def newest_file(self) -> Optional[Path]:
        """The newest checkpoint of any state, damaged and earlier-format ones included: the trace of an earlier
        run."""
        found = [*self.steps(), *self.dir.glob("step_*.damaged"), *self.legacy()]
        return max(found, key=lambda p: (_step_of(p), p.name)) if found else None

    def _record(self, path: Path) -> tuple[Optional[dict], Optional[str]]:
        """({file name: {bytes, sha256}}, None) or (None, why the checksum file is unusable)."""
        try:
            files = json.loads((path / CHECKSUMS).read_text())["files"]
            return {str(n): {"bytes": int(r["bytes"]), "sha256": str(r["sha256"])} for n, r in files.items()}, None
        except FileNotFoundError:
            return None, "no checksum file: its save never finished"
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            return None, f"its checksum file is unreadable ({type(err).__name__})"

    def problem(self, path: Path, share: tuple[int, int] = (0, 1)) -> Optional[str]:
        """None if the checkpoint folder ``path`` is intact, else what is wrong, in words. ``share`` (index, count):
        only every count-th file from the index-th is read and hashed (the checksum file is read whole)."""
        files, why = self._record(path)
        if files is None:
            return why
        index, count = share
        for name in sorted(files)[index::count]:
            problem = _file_problem(path / name, files[name])
            if problem:
                return problem
        return None

    def _looks_complete(self, path: Path) -> bool:
        """Checksum file present and every file of the size it records (no file is read)."""
        files, _ = self._record(path)
        try:
            return files is not None and all((path / n).stat().st_size == r["bytes"] for n, r in files.items())
        except OSError:
            return False

    def latest(self) -> Optional[Path]:
        """The newest checkpoint that looks complete, without reading it; :meth:`resumable` verifies contents."""
        return next((path for path in reversed(self.steps()) if self._looks_complete(path)), None)

    def resumable(self, dims: Optional[ParallelDims] = None) -> tuple[Optional[Path], Optional[str]]:
        """(newest intact checkpoint or None, a one-line message naming the damaged newer ones or None); collective,
        the files of each candidate verified by all ranks together. Damaged checkpoints newer than the chosen one are
        renamed ``<name>.damaged``. Raises CheckpointError if there are checkpoints and none is intact (the caller
        must not start over on top of them), ConfigError if the newest is of an earlier format."""
        distributed = dims is not None and dims.distributed
        listing = [[str(p) for p in self.steps()], [str(p) for p in self.legacy()]]
        if distributed:  # one listing for every rank: the logging rank's
            dist.broadcast_object_list(listing, src=0)
        steps, legacy = ([Path(p) for p in names] for names in listing)
        if legacy and (not steps or _step_of(legacy[-1]) > _step_of(steps[-1])):
            raise ConfigError(f"checkpoint {legacy[-1]} was written by an earlier version of this recipe (one file, "
                              f"format 2; this version reads format {FORMAT}, a folder of shards): convert it with "
                              f"`python -m launcher.checkpoint convert {self.dir.parent}`, then rerun")
        damaged, chosen = [], None
        share = (dims.rank, dims.world_size) if distributed else (0, 1)
        for path in reversed(steps):
            problems = [self.problem(path, share)]
            if distributed:
                problems = [None] * dims.world_size
                dist.all_gather_object(problems, self.problem(path, share))
            problem = next((p for p in problems if p), None)
            if problem is None:
                chosen = path
                break
            damaged.append((path, problem))
        if not distributed or dims.is_logging_rank:
            for bad, _ in damaged:
                bad.replace(bad.with_name(bad.name + ".damaged"))
        if distributed:
            dist.barrier()
        if not damaged:
            return chosen, None
        named = "; ".join(f"{bad} is damaged ({problem})" for bad, problem in damaged)
        if chosen is None:
            raise CheckpointError(f"no intact checkpoint to resume: {named}; renamed to *.damaged; set "
                                  "checkpoint.resume=false run.overwrite=true to start over")
        return chosen, f"{named}; renamed to *.damaged, resuming from {chosen.name}"

    def save(self, step: int, entries: dict[str, Any], dims: Optional[ParallelDims] = None) -> Path:
        """Write this rank's ``entries`` (fqn -> :class:`Sharded` or a small object) as checkpoint ``step``, then
        publish it atomically (module docstring). Collective; every rank raises the same CheckpointError if any part
        of the save fails (the partial folder is removed, the earlier checkpoints are untouched)."""
        path = self.dir / self.name(step)
        tmp = path.with_name(path.name + ".tmp")
        distributed = dims is not None and dims.distributed
        leader = not distributed or dims.is_logging_rank
        fs = _HashingFileSystem(self.writer)
        error = None
        try:
            if leader:  # a folder left by a save that was killed: start afresh
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        except OSError as err:
            error = err.strerror or str(err)
        if distributed:
            error = _first_error(error, dims)
        if error is None:
            try:
                writer = _BoundedFilesWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
                writer.fs = fs
                sharded.save(entries, writer)
            except (Exception, CheckpointException) as err:  # noqa: B902 (DCP's exception is a BaseException)
                error = _one_line(err)
            if distributed:
                error = _first_error(error, dims)
        records = [fs.written]
        if error is None and distributed:
            records = [None] * dims.world_size if leader else None
            dist.gather_object(fs.written, records, dst=0)
        if error is None and leader:
            try:
                self._publish(tmp, path, {n: r for rank in records for n, r in rank.items()})
            except OSError as err:
                error = err.strerror or str(err)
        if distributed:
            error = _first_error(error if leader else None, dims)
        if error is not None:
            if leader:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {path} ({error}); the previous checkpoints are intact: "
                                  "fix the cause (e.g. free disk space) and rerun the same command to resume")
        return path

    def _publish(self, tmp: Path, path: Path, files: dict[str, dict]) -> None:
        """The checksum file (the shard files' records, the metadata file hashed here), flushed; then the rename."""
        for name in (".metadata",):
            sha = hashlib.sha256((tmp / name).read_bytes())
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha.hexdigest()}
        sums = tmp / CHECKSUMS
        sums.write_text(json.dumps({"format": FORMAT, "files": dict(sorted(files.items()))}, indent=1) + "\n")
        _fsync_path(sums)
        _fsync_path(tmp)
        aside = path.with_name(path.name + ".replaced")
        if path.exists():  # the same step saved again (a tool re-saving a loaded state): the old one goes after
            shutil.rmtree(aside, ignore_errors=True)
            path.rename(aside)
        tmp.rename(path)
        _fsync_path(self.dir)
        shutil.rmtree(aside, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        """Keep the KEEP newest intact-looking checkpoints; delete everything of an older step (checkpoints,
        damaged, temporary and earlier-format ones). So the newest good checkpoint is never deleted."""
        kept = [p for p in self.steps() if self._looks_complete(p)]
        if not kept:
            return
        oldest_kept = _step_of(kept[-KEEP:][0])
        for path in self.dir.glob("step_*"):
            step = _step_of(path)
            if step is not None and step < oldest_kept:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def keep(self, step: int, label: str) -> Path:
        """Keep step ``step``'s checkpoint outside the two-kept rotation as ``<label>_step_XXXXXXXX/`` (hard links to
        its files where the file system allows, else copies). Pruning never touches these;
        analysis.checkpoint_delta_bias and a resume pointed at them read them like any checkpoint. The logging rank
        calls it, after the save."""
        source = self.dir / self.name(step)
        kept = self.dir / f"{label}_{source.name}"
        shutil.rmtree(kept, ignore_errors=True)
        kept.mkdir()
        for src in source.iterdir():
            try:
                os.link(src, kept / src.name)
            except OSError:
                shutil.copyfile(src, kept / src.name)
        _fsync_path(self.dir)
        return kept

    def read(self, path: Path, entries: dict[str, Any]) -> dict[str, Any]:
        """Fill ``entries`` from the checkpoint folder ``path`` (launcher/sharded.py: :class:`Sharded` chunks in
        place, objects given as None replaced). Collective. Any failure is a damaged checkpoint to the user, one
        line, never a traceback."""
        try:
            return sharded.load(entries, path)
        except (Exception, CheckpointException) as err:  # noqa: B902
            raise CheckpointError(f"checkpoint {path} cannot be read ({_one_line(err)}); move it away to resume from "
                                  "the one before, or set checkpoint.resume=false run.overwrite=true") from None

    def run_state(self, path: Path) -> dict:
        """The ``run`` entry (step, configuration, ...) of a checkpoint; collective."""
        state = self.read(path, {RUN: None})[RUN]
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {path} has no run state of format {FORMAT}; move it away to resume "
                                  "from the one before, or set checkpoint.resume=false run.overwrite=true")
        return state


def _first_error(error: Optional[str], dims: ParallelDims) -> Optional[str]:
    """The first rank's error, on every rank (None if no rank had one)."""
    errors = [None] * dims.world_size
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


# ------------------------------------------------------------------------------------------------------------------
# Training state <-> entries


def training_entries(pieces: list[Piece], dims: ParallelDims) -> dict[str, Sharded]:
    """Entries of the engine's pieces (:meth:`Engine.state_pieces` to save, :meth:`Engine.prepare_state_load` to
    load): each piece as chunks at their offsets in the single-device tensor (its tensor-parallel offset added)."""
    entries: dict[str, Sharded] = {}
    for piece in pieces:
        shard = shard_of(piece.param)
        shape = list(piece.local_shape)
        offset = [0] * len(shape)
        if shard is not None:
            offset[shard.dim] = dims.tp_rank * shape[shard.dim]
            shape[shard.dim] *= shard.parts
        target = entries.setdefault(entry(piece.key, piece.name), Sharded(tuple(shape)))
        data = piece.data.view(-1)  # a view: loading writes through it
        for at, chunk in flat_range_chunks(piece.local_shape, piece.start, data):
            target.add(tuple(a + o for a, o in zip(at, offset)), chunk)
    return entries


def fp8_entries(engine: Engine, dims: ParallelDims) -> dict[str, Any]:
    """FP8 delayed-scaling state of this rank's FFNs, from one rank per pipeline stage (the state is the same on
    every rank of a stage's amax group)."""
    if dims.dp_rank or dims.tp_rank:
        return {}
    return {fp8_entry(name): state for name, state in scaling_state(engine.blocks()).items()}


def fp8_destinations(engine: Engine, saved: set[str], precision: PrecisionConfig) -> dict[str, None]:
    """The FP8 delayed-scaling entries this rank's FFNs would take from a checkpoint holding ``saved``."""
    if not precision.fp8_ffn:
        return {}
    return {fp8_entry(f"blocks.{i}.mlp"): None for i in engine.blocks() if fp8_entry(f"blocks.{i}.mlp") in saved}


def load_fp8_scaling(engine: Engine, read: dict[str, Any], precision: PrecisionConfig) -> None:
    """Install the FP8 delayed-scaling state read for :func:`fp8_destinations` into this rank's FP8 FFNs (none
    saved: they start fresh, as a new run does; e.g. a checkpoint written with BF16 FFNs)."""
    state = {key[len("fp8/"):]: value for key, value in read.items() if key.startswith("fp8/") and value is not None}
    if state:
        load_scaling_state(engine.blocks(), state, precision)


def check_fits(saved: dict[str, Optional[tuple[int, ...]]], model: nn.Module, path: Path) -> None:
    """Raise ConfigError naming the first parameter whose shape differs between the checkpoint (``saved``: entry ->
    global shape) and this (single-device or meta) model, or that the checkpoint lacks."""
    for name, param in named_parameters(model):
        shape = saved.get(entry(PARAM, name))
        if shape is None:
            raise ConfigError(f"checkpoint {path} has no tensor {name}: it was written for another model; use "
                              "another run.experiment or checkpoint.resume=false")
        expected = full_shape(param)
        if tuple(shape) != expected:
            hint = ""
            if name == "tok_emb.weight" and tuple(shape[1:]) == expected[1:]:
                hint = f" (vocabulary {shape[0]} there, {expected[0]} here)"
            raise ConfigError(f"checkpoint {path} does not fit this configuration: {name} is {tuple(shape)} there and "
                              f"{expected} here{hint}; use another run.experiment or checkpoint.resume=false")


def load_model_weights(path: Path, model: nn.Module) -> None:
    """The checkpoint's parameters into a plain, materialised single-device ``model`` (one process: a tool's path,
    e.g. analysis/checkpoint_delta_bias.py; training reads through the engine's pieces)."""
    check_fits(sharded.saved_shapes(path), model, path)
    pieces = [Piece(name, PARAM, p, tuple(p.shape), 0, p.detach()) for name, p in named_parameters(model)]
    sharded.load(training_entries(pieces, ParallelDims()), path, alone=True)


def read_whole_checkpoint(path: Path) -> dict:
    """A checkpoint as one dict of whole tensors in this process's memory (``model``: {name: tensor},
    ``optimizer``: {adam_step, state: {name: {moment: tensor}}}, ``fp8_scaling``, ``rng``, ``monitors`` and the run
    state's keys): for tests and tools on small models, never for training."""
    whole = sharded.read_whole(path)
    out = dict(whole[RUN])
    out["model"] = {k[len("model/"):]: v for k, v in whole.items() if k.startswith("model/")}
    state: dict[str, dict] = {}
    for key in ADAM_STATE_KEYS:
        for k, v in whole.items():
            if k.startswith(f"optim/{key}/"):
                state.setdefault(k[len(f"optim/{key}/"):], {})[key] = v
    out["optimizer"] = {"adam_step": out["adam_step"], "state": state}
    out["fp8_scaling"] = {k[len("fp8/"):]: v for k, v in whole.items() if k.startswith("fp8/")}
    out["rng"] = [whole[rng_entry(r)] for r in range(out["world_size"])]
    out["monitors"] = {k: v for k, v in whole.items() if k.startswith("monitors/")}
    return out


# ------------------------------------------------------------------------------------------------------------------
# Conversion of format-2 checkpoints


def convert(run_dir: Path) -> Path:
    """Rewrite the newest single-file (format 2) checkpoint of ``run_dir`` as a format-3 folder (one process), and
    rename the old file ``*.pt.converted``. Its checksum is verified first."""
    from launcher.monitors.monitors import entries_from_format2

    store = CheckpointStore(run_dir)
    if not store.legacy():
        raise CheckpointError(f"{store.dir} holds no single-file checkpoint (step_*.pt) to convert")
    old = store.legacy()[-1]
    recorded = old.with_name(old.name + ".sha256")
    try:
        record = json.loads(recorded.read_text())
        problem = _file_problem(old, {"bytes": int(record["bytes"]), "sha256": str(record["sha256"])})
    except (OSError, ValueError, KeyError, TypeError):
        problem = f"its checksum file {recorded.name} is missing or unreadable"
    if problem:
        raise CheckpointError(f"{old} is damaged ({problem}); it cannot be converted")
    state = torch.load(old, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(state, dict) or state.get("format") != 2:
        raise CheckpointError(f"{old} is not a format-2 checkpoint; only those can be converted")
    whole = lambda t: Sharded(tuple(t.shape), [((0,) * t.dim(), t)])  # noqa: E731
    entries: dict[str, Any] = {entry(PARAM, n): whole(t) for n, t in state["model"].items()}
    optim = state["optimizer"]
    for name, moments in optim["state"].items():
        entries.update({entry(k, name): whole(v) for k, v in moments.items()})
    entries.update({fp8_entry(n): s for n, s in (state.get("fp8_scaling") or {}).items()})
    entries.update({rng_entry(r): s for r, s in enumerate(state["rng"])})
    if state.get("monitors"):
        entries.update(entries_from_format2(state["monitors"]))
    entries[RUN] = {"format": FORMAT, "step": state["step"], "adam_step": optim["adam_step"], "guard": state["guard"],
                    "layout": state.get("layout"), "world_size": len(state["rng"]), "config": state.get("config")}
    path = store.save(state["step"], entries)
    old.rename(old.with_name(old.name + ".converted"))
    recorded.rename(recorded.with_name(recorded.name + ".converted"))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.checkpoint", description="Checkpoint tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="rewrite a run folder's newest single-file checkpoint (format 2) as a "
                                          "folder of shards (format 3), which every layout resumes")
    conv.add_argument("run_dir", type=Path, help="the arm's run folder (runs/<experiment>/<arm>)")
    args = parser.parse_args(argv)
    try:
        path = convert(args.run_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}; the same training command resumes from it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
