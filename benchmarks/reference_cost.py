"""CPU time of the PyTorch reference's forward + backward per numerics mode (the path the model trains with on CPU).

    python -m benchmarks.reference_cost [--shape 8,6,256,64] [--modes fa2/none fa2/exact_delta ...] [--reps 7]

Prints, per mode, the median wall time of one causal fwd+bwd (bf16 inputs, FP32 arithmetic) over ``--reps`` calls
after one warm-up call (the modes take turns), and its ratio to the first mode's. Run single-threaded
(``OMP_NUM_THREADS=1``) on a shared machine: other jobs slow torch's multi-threaded kernels unevenly. The GPU kernel's cost is what
``benchmarks.attention`` measures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_modes(shape, modes: list[str], reps: int) -> dict[str, float]:
    """Median seconds of one fwd+bwd per mode; the modes take turns call by call, so that a change in the machine's
    load reaches every mode alike."""
    import kernels

    q, k, v, d_out = (torch.randn(shape).bfloat16() for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for i in range(reps + 1):
        for mode in modes:
            rounding, fix = mode.split("/")
            for t in leaves:
                t.grad = None
            start = time.perf_counter()
            kernels.reference_attention(*leaves, True, rounding, fix).backward(d_out)
            if i:  # the first round warms up
                times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(t) for mode, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,6,256,64", help="B,H,T,D (default: the CPU training shape of the docs)")
    parser.add_argument("--modes", nargs="+", default=["fa2/none", "fa2/fp32_output", "fa2/exact_delta",
                                                       "paper/none", "paper/exact_delta"])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    shape = tuple(int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    print(f"reference fwd+bwd, shape {shape}, {torch.get_num_threads()} thread(s), median of {args.reps}")
    medians = time_modes(shape, args.modes, args.reps)
    base = medians[args.modes[0]]
    for mode, t in medians.items():
        print(f"{mode:24s} {t * 1e3:8.1f} ms  {t / base:5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
