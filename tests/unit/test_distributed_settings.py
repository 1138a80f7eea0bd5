"""distributed.timeout_minutes reaches the process group; the flight recorder's environment (NCCL only)."""

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist

from launcher import distributed
from launcher.config import ConfigError, DistributedConfig, load_config


def test_the_timeout_reaches_the_process_group(monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(distributed.parallel_dims, "build", lambda *args: "dims")
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    assert distributed.init("cpu", settings=DistributedConfig(timeout_minutes=45), dump_dir=Path("/nonexistent")) == "dims"
    assert seen["timeout"] == datetime.timedelta(minutes=45) and seen["backend"] == "gloo"
    assert "TORCH_FR_BUFFER_SIZE" not in distributed.os.environ  # gloo has no flight recorder


def test_the_flight_recorder_dumps_into_the_experiment_folder(tmp_path):
    env = distributed.flight_recorder_env(500, tmp_path / "flight_recorder")
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")


def test_a_timeout_of_zero_is_refused_with_what_to_set():
    with pytest.raises(ConfigError, match="distributed.timeout_minutes must be > 0"):
        load_config("smoke", ["distributed.timeout_minutes=0"])


@pytest.mark.parametrize("visible, local_rank, index", [(8, 5, 5), (1, 5, 0), (1, 0, 0)])
def test_each_process_takes_its_gpu_whatever_the_binding(monkeypatch, visible, local_rank, index):
    """One process per GPU whether each task sees the node's GPUs (its local rank's) or only its own (index 0)."""
    chosen = []
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(distributed.torch.cuda, "set_device", chosen.append)
    assert distributed.resolve_device("auto", local_rank) == distributed.torch.device("cuda", index)
    assert chosen == [index]


def test_a_local_rank_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match="local rank 5 has no GPU \\(4 visible\\)"):
        distributed.resolve_device("cuda", 5)


def test_one_hardware_queue_only_for_the_overlapped_tensor_parallel_reduction(monkeypatch):
    from launcher.config import ParallelConfig

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    distributed.prepare_environment(ParallelConfig(tensor_parallel=2))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in distributed.os.environ
    distributed.prepare_environment(ParallelConfig(tensor_parallel=2, tp_async_grad_reduce=True))
    assert distributed.os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
