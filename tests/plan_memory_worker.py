"""Worker: ``python -m tests.plan_memory_worker DATA [overrides ...]`` builds the smoke recipe (with the overrides,
without and then with activation checkpointing) in one process on the CPU as the trainer does and prints, in bytes,
what its memory grew by: ``weights`` (materialising
the meta model), ``first step`` (the peak of the first optimizer step over the weights: gradients, Adam's moments,
activations) and ``optimizer`` (what stays after it), ``later step`` (the peak of the second step over what the first
left: gradients and activations). Resident memory is sampled every 0.1 ms; glibc is told to return freed memory
after every phase (MALLOC_MMAP_THRESHOLD_ set by the caller sends large blocks to mmap, returned at once), so the
figures follow live tensors (the data folder gives the vocabulary only). tests/unit/test_plan.py compares them with
launcher.plan's; :func:`gpu_peak` is the GPU side (tests/gpu/test_plan_gpu.py)."""

import ctypes
import sys
import threading
import time

import torch

from launcher.config import load_config
from launcher.parallel.build import build_engine
from launcher.parallel.dims import ParallelDims
from launcher.parallelize import parallelize
from launcher.trainer import autocast_factory, build_model

LIBC = ctypes.CDLL("libc.so.6")


def resident() -> int:
    LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Peak:
    def __enter__(self):
        self.before = resident()
        self.peak, self._done = self.before, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            with open("/proc/self/statm") as f:
                self.peak = max(self.peak, int(f.read().split()[1]) * 4096)
            time.sleep(0.0001)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()


def build(config, device: torch.device, weights: dict = None):
    """(engine, micro-batches of one step, autocast) of ``config`` on one process, as the trainer builds them;
    ``weights["bytes"]``: what materialising the model added to the resident memory."""
    dims = ParallelDims(device=device)
    model, _, _ = build_model(config)
    before = resident()
    part = parallelize(model, config, dims)
    if weights is not None:
        weights["bytes"] = resident() - before
    engine = build_engine(part, config, dims)
    gen = torch.Generator().manual_seed(0)
    shape = (config.data.micro_batch_size, config.data.seq_len)
    count = config.data.global_batch_size // config.data.micro_batch_size
    micro = [(x.to(device), x.to(device)) for x in
             (torch.randint(0, config.model.vocab_size, shape, generator=gen) for _ in range(count))]
    return engine, micro, autocast_factory(config, device)


def gpu_peak(config) -> int:
    """torch.cuda.max_memory_allocated of the second of two optimizer steps on one GPU (bytes)."""
    device = torch.device("cuda", 0)
    engine, micro, autocast = build(config, device)
    engine.train_step(micro, autocast, 1e-4, lambda loss, norm: None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(micro, autocast, 1e-4, lambda loss, norm: None)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def main() -> int:
    data, overrides = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    for checkpointing in (False, True):
        config = load_config("smoke", [f"data.data_dir={data}", *overrides,
                                       f"parallel.activation_checkpointing={checkpointing}"], arm="baseline")
        weights = {}
        engine, micro, autocast = build(config, torch.device("cpu"), weights)
        with Peak() as first:
            engine.train_step(micro, autocast, 1e-4, lambda loss, norm: None)
        optimizer = resident() - first.before
        with Peak() as later:
            engine.train_step(micro, autocast, 1e-4, lambda loss, norm: None)
        print(f"checkpointing {checkpointing}: weights {weights['bytes']} first step {first.peak - first.before} "
              f"optimizer {optimizer} later step {later.peak - later.before}", flush=True)
        del engine, micro
    return 0


if __name__ == "__main__":
    sys.exit(main())
