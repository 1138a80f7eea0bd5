"""Time and memory of the monitors for ONE layer of a large model's shape, on whatever device is present:

    python -m benchmarks.monitor_scale [--d-model 4096] [--heads 32] [--seq 1024] [--probe-batch 2]
    torchrun --nproc-per-node 2 -m benchmarks.monitor_scale ...      # tensor parallel over the processes

Builds a one-layer GPT of that width (vocabulary 256; meta device, then this rank's slice materialised, as the
trainer does), and calls ``launcher.monitors.monitors.Monitors`` on it: the spectral part twice (the first call
starts each tracked weight from its exact top singular vector: a d x d Gram matrix and its eigendecomposition, and
stores W_Q and W_K for the Q-K update; the second is the tracked power iteration and the Q-K update spectra), then
the probe part without and with the delta-bias monitor of the layer (with the Q-K activation spectra).
Prints per rank, for each call: wall seconds and the growth of resident memory (CPU; peak allocation on a GPU) over
the call, and the scalars logged. Everything the monitors do is per layer, so a stage of L layers costs L times this
(docs/monitoring.md, "At scale"). Attention is SDPA (production numerics): the probe forward is not what is measured.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from launcher import distributed
from launcher.config import load_config
from launcher.parallel import dims as parallel_dims
from launcher.parallelize import parallelize
from launcher.trainer import build_model


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _Peak:
    """Growth of this process's memory during the context: resident set (sampled) on a CPU, allocator peak on a GPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            self.before = self.peak = _resident()
            self._done = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, _resident())
            time.sleep(0.0005)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._done.set()
            self._thread.join()
        self.seconds = time.perf_counter() - self.start
        self.grew = self.peak - self.before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.monitor_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--ffn-mult", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--probe-batch", type=int, default=2)
    args = parser.parse_args(argv)
    world = distributed.world_size_from_env()
    base = distributed.init("auto")
    from launcher.monitors.monitors import Monitors

    overrides = [f"model.d_model={args.d_model}", f"model.n_head={args.heads}", f"model.ffn_mult={args.ffn_mult}",
                 "model.n_layer=1", "model.vocab_size=256", f"model.max_seq_len={args.seq}", f"data.seq_len={args.seq}",
                 f"data.global_batch_size={world}", "data.micro_batch_size=1", f"parallel.tensor_parallel={world}",
                 "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2", "precision.dtype=fp32",
                 f"monitor.probe_batch_size={args.probe_batch}", "monitor.spectral_interval=1",
                 "monitor.probe_interval=1"]
    results = []
    for delta in (False, True):
        config = load_config("smoke", [*overrides, f"monitor.delta_bias_layers={[0] if delta else []}"],
                             arm="baseline", world_size=world)
        dims = parallel_dims.build(config.parallel, world, base.rank, base.local_rank, base.device)
        part = parallelize(build_model(config)[0], config, dims)
        tokens = torch.randint(0, 256, (args.probe_batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
        probe = (tokens[:, :-1].to(dims.device), tokens[:, 1:].to(dims.device))
        monitors = Monitors(config, part, probe, None, backend="sdpa", dims=dims)
        def spectral():  # what a spectral call does: the norms, then the Q-K update spectra (monitor.qk_update)
            return {**monitors._spectral(), **(monitors._qk_update() if monitors.qk_update is not None else {})}

        calls = [("spectral, fresh start", spectral), ("spectral, tracked", spectral)] if not delta else []
        calls.append((f"probe{' + delta bias' if delta else ''}", lambda: monitors._probe(dims.device)))
        for name, call in calls:
            with torch.no_grad(), _Peak(dims.device) as peak:
                values = call()
            results.append((name, peak.seconds, peak.grew, len(values)))
    shape = f"d {args.d_model}, {args.heads} heads, FFN x{args.ffn_mult}, probe {args.probe_batch} x {args.seq}, tp {world}"
    for name, seconds, grew, count in results:
        print(f"rank {base.rank} [{shape}] {name}: {seconds:.2f} s, +{grew / 2**20:.0f} MiB, {count} scalars",
              flush=True)
    distributed.shutdown(wait_for_all=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
