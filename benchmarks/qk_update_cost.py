"""Cost of the Q-K update and activation spectra monitors (launcher/monitors/qk_update.py) at real model shapes.

    python -m benchmarks.qk_update_cost [--device cpu|cuda] [--calls 5] [--shapes gpt2_small gpt_1p3b]

Per shape, on random weights (the cost does not depend on their values): the median time of one layer's update
spectra (the snapshot copy of W_Q and W_K, thin QRs of the d x 2hd factors, the 2hd x 2hd SVDs, every head at
once), of one layer's activation entropy (qk_tokens probe tokens), and what one monitor call costs for every layer;
and the device memory the snapshots hold (what monitor.qk_layers bounds). It does not need a data set or a model.
The amortised share of a training step follows from the step time of the recipe on the same device
(benchmarks.monitor_overhead measures the whole spectral and probe calls, these parts included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from launcher.monitors.qk_update import QKUpdateTracker, activation_entropy, token_positions

SHAPES = {  # name: (layers, heads, head_dim, probe sequences x length)
    "gpt2_small": (12, 12, 64, (2, 1024)),
    "gpt_1p3b": (24, 16, 128, (2, 2048)),
}


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.qk_update_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per part (after one warm-up call)")
    parser.add_argument("--tokens", type=int, default=64, help="monitor.qk_tokens")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device {name}; torch {torch.__version__}")
    print("| shape | update spectra per layer (ms) | activation entropy per layer (ms) | one call, all layers (ms) "
          "| snapshot memory per layer / all layers (MiB) |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        layers, heads, hd, (batch, seq) = SHAPES[shape]
        d = heads * hd
        g = torch.Generator(device="cpu").manual_seed(0)
        wq, wk = (0.02 * torch.randn(heads, hd, d, generator=g)).to(device), \
            (0.02 * torch.randn(heads, hd, d, generator=g)).to(device)
        moved = [(w + 1e-3 * torch.randn(w.shape, generator=g).to(device)) for w in (wq, wk)]
        q, k = (torch.randn(batch, heads, seq, hd, generator=g).to(device, torch.bfloat16) for _ in range(2))
        positions = token_positions(batch, seq, args.tokens)
        tracker = QKUpdateTracker()
        tracker(0, wq, wk)
        flip = [moved, (wq, wk)]

        def update(i=[0]):
            i[0] += 1
            tracker(0, *flip[i[0] % 2])  # the weights move between calls

        update()
        activation_entropy(q, k, positions)
        up = statistics.median(_timed(update, device) for _ in range(args.calls))
        act = statistics.median(_timed(lambda: activation_entropy(q, k, positions), device) for _ in range(args.calls))
        mib = 2 * heads * hd * d * 4 / 2**20
        print(f"| {shape} ({layers} x {d}, {heads} heads of {hd}) | {up * 1e3:.1f} | {act * 1e3:.1f} | "
              f"{layers * (up + act) * 1e3:.0f} | {mib:.1f} / {layers * mib:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
