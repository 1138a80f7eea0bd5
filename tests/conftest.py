"""Shared fixtures of the five test tiers: tests/unit (CPU, in-process), tests/integration (subprocess runs of the
launcher's tools), tests/distributed (CPU, several gloo processes under torchrun; marked distributed), tests/slurm
(jobs submitted to a SLURM started on this machine; marked slurm, skipped without one), tests/gpu (marked gpu;
skipped without a CUDA GPU)."""

import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A fresh random seed per test (fresh inputs every run), printed so that a failure can be replayed."""
    s = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
    torch.manual_seed(s)
    print(f"seed={s}")
    return s


@pytest.fixture
def single_thread():
    """For tests on tiny tensors: one thread is faster, and immune to oversubscription when CI shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def kjv_data(tmp_path_factory) -> Path:
    """The embedded corpus prepared once per test session (trained BPE, ~5 s)."""
    from launcher.prepare_data import prepare

    out = tmp_path_factory.mktemp("kjv")
    prepare(["kjv"], out, tokenizer="bpe", vocab_size=2048)
    return out


@pytest.fixture
def tiny_overrides(kjv_data, tmp_path) -> list[str]:
    """Overrides that shrink the smoke recipe to seconds on CPU and keep outputs in tmp_path."""
    return [
        f"data.data_dir={kjv_data}", f"run.out_dir={tmp_path / 'runs'}", "run.max_steps=6", "run.log_interval=1",
        "model.n_layer=2", "model.d_model=64", "model.n_head=1", "model.max_seq_len=64", "data.seq_len=64",
        "data.global_batch_size=4", "data.micro_batch_size=2", "optim.warmup_steps=2", "optim.decay_steps=6",
        "eval.interval=3", "eval.batches=2", "monitor.spectral_interval=0", "monitor.probe_interval=0",
        "checkpoint.interval=0",
    ]
