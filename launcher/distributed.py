"""Process-group setup for single-process, torchrun and SLURM (srun) launches."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from launcher.config import ConfigError, ParallelConfig
from launcher.parallel import dims as parallel_dims
from launcher.parallel.dims import ParallelDims


def _env_from_slurm() -> None:
    """Map srun's SLURM_* variables onto torchrun's, so `srun python -m launcher.pretrain` works without torchrun."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) == 1:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        raise ConfigError("srun without torchrun needs MASTER_ADDR (the first node's address); slurm/*.sh sets it")


def world_size_from_env() -> int:
    """Number of processes this launch has (torchrun's WORLD_SIZE or srun's SLURM_NTASKS)."""
    _env_from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device=cuda but no CUDA GPU is visible; use run.device=cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); start at "
                              "most one process per GPU on each node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(requested_device: str = "auto", parallel: ParallelConfig | None = None) -> ParallelDims:
    """Initialise torch.distributed from env:// when launched with several processes (gloo on CPU, NCCL on GPU),
    and create the groups of the parallel layout."""
    _env_from_slurm()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, init_method="env://", timeout=datetime.timedelta(minutes=10), **kwargs)
    return parallel_dims.build(parallel or ParallelConfig(), world, rank, local_rank, device)


def default_cpu_threads(cores: int, processes: int, load: float) -> int:
    """Threads per process for a CPU run when OMP_NUM_THREADS is not set: this node's usable cores shared by its
    processes, less what other programs keep busy (the 1-minute load average). PyTorch's own default takes every
    core; on a shared, loaded machine its threads then wait for each other and a step takes ~50x longer (2 cores,
    load 4: measured 2026-12-01)."""
    share = max(1, cores // max(1, processes))
    return max(1, min(share, round(share - load / max(1, processes))))


def set_cpu_threads() -> str:
    """Apply the CPU thread count (OMP_NUM_THREADS when set, else :func:`default_cpu_threads`); returns the
    progress line that says what was chosen and why."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"CPU threads: {torch.get_num_threads()} per process (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = default_cpu_threads(cores, processes, load)
    torch.set_num_threads(threads)
    return (f"CPU threads: {threads} per process ({cores} core(s), {processes} process(es) here, load {load:.1f}; "
            "set OMP_NUM_THREADS to choose)")


def shutdown(wait_for_all: bool = False) -> None:
    """Destroy the process groups. ``wait_for_all`` (after a normal end): first wait until every rank is done, so that
    none tears its groups down while another still uses them. Not after an error: the other ranks may never come."""
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()


def any_rank(flag: bool, dims: ParallelDims) -> bool:
    """True if ``flag`` is true on any rank (used so every rank stops at the same step)."""
    if not dims.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=dims.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj, dims: ParallelDims) -> list:
    """``obj`` of every rank, in rank order, on every rank."""
    if not dims.distributed:
        return [obj]
    out = [None] * dims.world_size
    dist.all_gather_object(out, obj)
    return out
