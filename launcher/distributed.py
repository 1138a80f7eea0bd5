"""Process-group setup for single-process, torchrun and SLURM (srun) launches."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from launcher.config import ConfigError, DistributedConfig, ParallelConfig
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
    """This process's device: its node-local rank's GPU among those it sees, or, where the site binds one GPU to
    each task (CUDA_VISIBLE_DEVICES naming one device: srun --gpus-per-task=1, --gpu-bind=single:1), that one."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device=cuda but no CUDA GPU is visible; use run.device=cpu or auto")
        visible = torch.cuda.device_count()
        index = 0 if visible == 1 else local_rank
        if index >= visible:
            raise ConfigError(f"local rank {local_rank} has no GPU ({visible} visible); start at most one process "
                              "per GPU on each node")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def prepare_environment(parallel: ParallelConfig) -> None:
    """Settings that must be in the environment before CUDA starts: the overlapped tensor-parallel gradient
    reduction (parallel.tp_async_grad_reduce) issues its all-reduce before the weight-gradient product, and only one
    hardware queue per device (CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron sets it) makes the GPU run them in that
    order; elsewhere it would serialise other overlaps (ZeRO's), so it is set only then, and never over a value the
    environment has."""
    if parallel.tensor_parallel > 1 and parallel.tp_async_grad_reduce:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def flight_recorder_env(entries: int, dump_dir: Path) -> dict[str, str]:
    """The environment of NCCL's flight recorder (its current and earlier names): the last ``entries`` collectives
    kept per process, written to ``dump_dir``/rank_<r> when a collective times out."""
    prefix = str(dump_dir / "rank_")
    return {"TORCH_FR_BUFFER_SIZE": str(entries), "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def init(requested_device: str = "auto", parallel: ParallelConfig | None = None,
         settings: DistributedConfig | None = None, dump_dir: Path | None = None) -> ParallelDims:
    """Initialise torch.distributed from env:// when launched with several processes (gloo on CPU, NCCL on GPU),
    and create the groups of the parallel layout. ``settings``: the collective timeout and the flight recorder,
    whose dumps go to ``dump_dir`` (each variable only where the environment does not set it already)."""
    _env_from_slurm()
    settings = settings or DistributedConfig()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(requested_device, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if backend == "nccl" and settings.flight_recorder_entries and dump_dir is not None:
            dump_dir.mkdir(parents=True, exist_ok=True)
            for key, value in flight_recorder_env(settings.flight_recorder_entries, dump_dir).items():
                os.environ.setdefault(key, value)
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=datetime.timedelta(minutes=settings.timeout_minutes), **kwargs)
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


def exit_process(status: int) -> NoReturn:
    """End this process with ``status``. A member of a multi-process job (WORLD_SIZE > 1) whose work is done, its
    groups destroyed and its files closed skips the interpreter's finalisation (``os._exit`` after flushing stdout
    and stderr): during it a C++ thread of torch's gloo backend now and then aborts the process (SIGABRT,
    "terminate called without an active exception") after the run has finished and printed its summary, which
    turned finished runs into failed ones (2026-12-06: 2 of ~1,000 multi-process runs in two CI runs, 1 of 46 repeats
    of one 2-process run; docs/training.md). A single process exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)


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
