"""Host (CPU) time of one eager attention call, forward and backward, on a CUDA GPU.

    python -m benchmarks.host_overhead [--shape 1,2,128,64] [--mode fa2/dynamic_max] [--calls 1000] [--out FILE.md]

At a tiny shape the GPU finishes each kernel in a few microseconds, so a loop of calls runs as fast as Python can
issue them: the time per call without synchronising is the host cost. Rows:

- ``triton, cached launch``: ``kernels.attention`` with one settings record, then ``backward``, as a model calls it
  (the default path);
- ``triton, Triton's launch``: the same after ``kernels.triton_flash.set_fast_launch(False)`` (every launch through
  ``JITFunction``);
- ``triton forward only``: under ``torch.no_grad``;
- ``triton forward / backward, no autograd``: the launch functions alone (allocations and four launches);
- ``sdpa <backend>``: torch's C++ path, for comparison;
- ``autograd floor``: an ``autograd.Function`` that returns its input's clone, forward and backward;
- ``CUDA graph replay``: the triton fwd+bwd captured once in a CUDA graph, replayed (static inputs).

``GPU-bound`` in a row means the loop took longer with a final synchronisation than without, i.e. the GPU, not
the host, set the pace (then the row is an upper bound of the host cost; use a smaller shape).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import cuda_missing
from benchmarks.attention import emit, parse_mode, parse_shape


ROUNDS = 5


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call, us per call including the GPU's finish) of the fastest of ROUNDS rounds of ``calls``
    calls, after a warm-up: the fastest round is the one least disturbed by other work on the host."""
    for _ in range(max(10, calls // 20)):
        fn()
    best = None
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        if best is None or host < best[0]:
            best = (host, total)
    return best[0] / calls * 1e6, best[1] / calls * 1e6


class _Clone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def rows(shape, mode: str, calls: int):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import kernels
    from kernels import triton_flash as tf
    from kernels.modes import AttentionSettings

    rounding, fix = mode.split("/")
    q, k, v, d_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def clear():
        q.grad = k.grad = v.grad = None

    settings = AttentionSettings(rounding=rounding, fix=fix, backend="triton")  # built once, as the model does

    def triton_step():
        clear()
        kernels.attention(q, k, v, settings).backward(d_out)

    def triton_forward():
        with torch.no_grad():
            kernels.attention(q, k, v, settings)

    nm = tf.prepare(q, k, v, settings)
    with torch.no_grad():
        out, lse, o32, _ = tf.forward(q, k, v, settings, nm)
    saved = o32 if nm.keeps_fp32_output else out

    def sdpa_step(backend):
        def step():
            clear()
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(d_out)
        return step

    def floor():
        clear()
        _Clone.apply(q).backward(d_out)

    out_rows = []

    def add(name, fn):
        host, total = per_call_us(fn, calls)
        out_rows.append((name, host, total))
        print(f"  {name}: {host:.1f} us host, {total:.1f} us with the GPU's finish", file=sys.stderr, flush=True)

    add("triton fwd+bwd, cached launch", triton_step)
    previous = tf.set_fast_launch(False)
    try:
        add("triton fwd+bwd, Triton's launch", triton_step)
    finally:
        tf.set_fast_launch(previous)
    add("triton forward only (no_grad)", triton_forward)
    add("triton forward launch, no autograd", lambda: tf.forward(q, k, v, settings, nm))
    add("triton backward launches, no autograd", lambda: tf.backward(d_out, q, k, v, saved, lse, None, settings, nm))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            sdpa_step(backend)()
        except RuntimeError as err:
            print(f"  sdpa {name}: unavailable ({str(err).splitlines()[0][:80]})", file=sys.stderr)
            continue
        add(f"sdpa {name} fwd+bwd", sdpa_step(backend))
    add("autograd floor (clone fwd+bwd)", floor)

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            triton_step()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        kernels.attention(q, k, v, settings).backward(d_out)
    add("triton fwd+bwd, CUDA graph replay", graph.replay)
    return out_rows


def to_markdown(out_rows, shape, mode) -> str:
    lines = [f"Host time per eager call on {torch.cuda.get_device_name()}, torch {torch.__version__}, shape "
             f"{','.join(map(str, shape))} bf16 causal, mode {mode}.", "",
             "| path | host us/call | us/call with the GPU's finish | |", "|---|---|---|---|"]
    for name, host, total in out_rows:
        bound = "GPU-bound" if total > 1.1 * host else ""
        lines.append(f"| {name} | {host:.1f} | {total:.1f} | {bound} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="1,2,128,64", type=parse_shape,
                        help="B,H,T,D (default 1,2,128,64: tiny, host-bound)")
    parser.add_argument("--mode", default="fa2/dynamic_max", type=parse_mode,
                        help="ROUNDING/FIX of the kernel (default fa2/dynamic_max)")
    parser.add_argument("--calls", type=int, default=1000, help=f"calls per round (default 1000; {ROUNDS} rounds per "
                                                                 "row, the fastest counts)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.calls < 10:
        parser.error("--calls must be at least 10")
    if cuda_missing("benchmarks.host_overhead", "it measures the cost of issuing GPU work"):
        return 2
    emit(to_markdown(rows(args.shape, args.mode, args.calls), args.shape, args.mode), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
