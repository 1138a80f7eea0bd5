"""Tensors held in pieces across ranks, written and read by torch.distributed.checkpoint (DCP).

A checkpoint entry is a tensor of the single-device model (a parameter, one of its Adam moments, a monitor's
per-head state) under its full, single-device shape. Each rank holds some rectangular chunks of it: its
tensor-parallel slice, or the part of that slice in its ZeRO partition, or a per-head block. :class:`Sharded` says
which, with the global offset of each chunk, and DCP does the rest: every rank writes its own chunks into its own
file (a chunk held by several ranks, e.g. a replicated parameter, is written once: DCP's deduplication picks the
rank with the least to write), and on loading every rank reads the parts of the saved chunks that overlap the chunks
it asks for, whichever layout wrote them. That is how a checkpoint written under one layout is resumed under any
other, without any rank assembling a whole tensor.

ZeRO partitions are contiguous ranges of a parameter's flattened (tensor-parallel) slice, which is not a rectangle
in general: :func:`flat_range_chunks` cuts such a range into at most three rectangles (the end of a first row, whole
rows, the start of a last row).

DCP's default planners handle plain tensors, DTensors and ShardedTensors; :class:`Sharded` implements the two
protocol methods the planners call for other objects (``__create_write_items__``, ``__create_chunk_list__``) and the
two planners below find its chunks by offset. Non-tensor values (small Python objects) are pickled by DCP as they
are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclasses.dataclass
class Sharded:
    """This rank's chunks of one tensor of global shape ``shape``: (global offsets, tensor shaped like the chunk),
    the tensors being views of where the values live (written from there, read into there)."""

    shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = dataclasses.field(default_factory=list)

    def size(self) -> torch.Size:  # DCP compares it with the saved size when loading
        return torch.Size(self.shape)

    def add(self, offsets: tuple[int, ...], tensor: torch.Tensor) -> None:
        if tensor.numel():
            self.chunks.append((tuple(offsets), tensor))

    def at(self, offsets) -> torch.Tensor:
        for at, tensor in self.chunks:
            if at == tuple(offsets):
                return tensor
        raise KeyError(f"no chunk at {tuple(offsets)}")

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(at)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(at), sizes=tensor.shape),
                              properties=TensorProperties.create_from_tensor(tensor), size=self.size()))
                for at, tensor in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(at), sizes=tensor.shape) for at, tensor in self.chunks]


def flat_range_chunks(local_shape: tuple[int, ...], start: int, flat: torch.Tensor
                      ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The elements [start, start + len(flat)) of a row-major tensor of shape ``local_shape``, held in the 1-D
    ``flat``, as rectangles: (offsets in the tensor, view of ``flat`` shaped like the rectangle). A 1-D tensor is one
    rectangle; a 2-D one at most three."""
    n = flat.numel()
    if n == 0:
        return []
    if len(local_shape) <= 1:
        return [((start,), flat)]
    if start == 0 and n == math.prod(local_shape):
        return [((0,) * len(local_shape), flat.view(local_shape))]
    if len(local_shape) != 2:
        raise ValueError(f"a part of a {len(local_shape)}-D tensor is not a rectangle: only 1-D and 2-D are cut")
    cols = local_shape[1]
    out, at, end = [], start, start + n
    while at < end:
        row, col = divmod(at, cols)
        if col or end - at < cols:  # a partial row: to the end of this row or of the range
            width = min(cols - col, end - at)
            out.append(((row, col), flat[at - start:at - start + width].view(1, width)))
            at += width
        else:  # whole rows
            rows = (end - at) // cols
            out.append(((row, 0), flat[at - start:at - start + rows * cols].view(rows, cols)))
            at += rows * cols
    return out


def _lookup(state_dict: dict, index: MetadataIndex, find):
    obj = state_dict[index.fqn]
    return obj.at(index.offset) if isinstance(obj, Sharded) else find(state_dict, index)


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, finding :class:`Sharded` chunks by their offsets."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index, lambda sd, i: super(_SavePlanner, self).lookup_object(i))


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading into :class:`Sharded` chunks by their offsets."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner first replaces meta-device tensors by real ones, and every value of a type it does not
        # know (a Sharded) by None; there is nothing to flatten either
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index, lambda sd, i: super(_LoadPlanner, self).lookup_tensor(i))


@contextlib.contextmanager
def _one_process_is_intended():
    """DCP warns at every save and load without a process group; one process is a layout like any other here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save(entries: dict[str, Any], writer: dcp.FileSystemWriter) -> None:
    """Write this rank's ``entries`` (fqn -> :class:`Sharded` or a picklable object) through ``writer``.
    Collective over the default process group (no process group: one process)."""
    with _one_process_is_intended():
        dcp.save(entries, storage_writer=writer, planner=_SavePlanner(flatten_state_dict=False))


def load(entries: dict[str, Any], path: Path, alone: bool = False) -> dict[str, Any]:
    """Read ``entries`` from the checkpoint folder ``path``: :class:`Sharded` chunks are filled in place, and each
    object entry (given as None) is replaced by the saved object. Entries absent from the checkpoint are left as
    given. Collective over the default process group, unless ``alone`` (this process reads by itself)."""
    planner = _LoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
    with _one_process_is_intended():
        dcp.load(entries, storage_reader=dcp.FileSystemReader(path), planner=planner, no_dist=alone)
    return entries


def saved_shapes(path: Path) -> dict[str, Optional[tuple[int, ...]]]:
    """Every entry of the checkpoint folder ``path``: fqn -> its global shape (None for an object)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {fqn: tuple(md.size) if hasattr(md, "size") else None for fqn, md in metadata.state_dict_metadata.items()}


def read_whole(path: Path, fqns: Optional[list[str]] = None) -> dict[str, Any]:
    """The entries ``fqns`` (all if None) of the checkpoint folder ``path`` as whole tensors and objects, in this
    process's memory: for tools and tests on small models, never in training (it assembles every tensor whole)."""
    shapes = saved_shapes(path)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    entries: dict[str, Any] = {}
    for fqn in fqns if fqns is not None else shapes:
        shape = shapes[fqn]
        if shape is None:
            entries[fqn] = None
        else:
            tensor = torch.empty(shape, dtype=metadata[fqn].properties.dtype)
            entries[fqn] = Sharded(shape, [((0,) * len(shape), tensor)])
    load(entries, path, alone=True)
    return {fqn: value.chunks[0][1] if isinstance(value, Sharded) and value.chunks else value
            for fqn, value in entries.items()}
