"""The process layout of a run: pipeline x data x tensor parallel sizes, this process's ranks and its groups.

Ranks are laid out with the tensor-parallel index fastest, then data, then pipeline:
``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``. Tensor-parallel groups (the chattiest: two all-reduces per block
and pass) are therefore consecutive ranks, i.e. GPUs of one node; this is also the order of DeepSpeed's
``PipeModelDataParallelTopology`` (axes pipe, data, model), so a pipeline engine sees the same groups.

With one process every size is 1, no process group exists, and the collectives below are no-ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from launcher.config import ConfigError, ParallelConfig, check_layout


@dataclass
class ParallelDims:
    """Sizes, ranks and process groups of one process (see the module docstring for the rank order)."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    pp_group: Optional[dist.ProcessGroup] = None
    amax_group: Optional[dist.ProcessGroup] = None
    """Tensor x data ranks of one pipeline stage: FP8 amax reductions span it and never the pipeline (a collective
    over the pipeline group would wait on stages that run other micro-batches; TransformerEngine#1006)."""
    dp_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of this process's data-parallel group, in data-parallel order."""
    mesh: Optional[object] = None
    """The DeviceMesh (pp, dp, tp) the groups come from (None with one process)."""

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_logging_rank(self) -> bool:
        """The one process that prints progress and writes TensorBoard events, batch offsets and checkpoints."""
        return self.rank == 0

    def describe(self) -> str:
        return f"{self.world_size} process(es) = dp {self.dp} x tp {self.tp} x pp {self.pp}"

    # ------------------------------------------------------------------------------------------------------------
    # DeepSpeed's "mpu" interface (model-parallel unit): the groups DeepSpeed uses for ZeRO sharding and for the
    # global gradient norm. "Model parallel" is tensor parallel here; the pipeline engine adds its own groups.

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)


def build(parallel: ParallelConfig, world_size: int, rank: int, local_rank: int, device: torch.device) -> ParallelDims:
    """Create the process groups of the layout (every rank must call this, in the same order): one DeviceMesh of
    shape (pp, dp, tp), whose row-major order is the rank order above, and its dimensions' groups. With NCCL (the
    default group bound to this rank's GPU) torch creates each dimension's groups with one communicator split
    (ncclCommSplit), instead of one world-wide group creation per group; the FP8 amax group is the flattened
    (dp, tp) submesh."""
    from torch.distributed.device_mesh import init_device_mesh

    problems = check_layout(world_size, parallel)
    if problems:
        raise ConfigError(problems[0])
    dims = ParallelDims(world_size, parallel.tensor_parallel, parallel.pipeline_parallel, rank, local_rank, device)
    dims.dp_ranks = [(dims.pp_rank * dims.dp + d) * dims.tp + dims.tp_rank for d in range(dims.dp)]
    if world_size == 1:
        return dims
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    dims.mesh = mesh
    dims.tp_group, dims.dp_group, dims.pp_group = (mesh.get_group(name) for name in ("tp", "dp", "pp"))
    dims.amax_group = mesh["dp", "tp"]._flatten("dp_tp").get_group()
    return dims
