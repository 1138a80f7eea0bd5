"""GPU time of each Triton attention kernel (forward; delta, dK/dV, dQ of the backward) for a grid of tile
configurations, to choose the autotuner's candidates.

    python -m benchmarks.attention_tiles [--shape 8,12,1024,64] [--mode fa2/none] [--jobs 8] [--out FILE.md]

Each launch is timed alone inside a CUDA graph (``triton.testing.do_bench_cudagraph``): kernel time without host
overhead. Configurations are compiled first by ``--jobs`` worker processes (Triton's disk cache then serves the
timing process). A configuration that does not fit the GPU (shared memory, registers) is listed as such. The
autotuner's own choice for the shape (``kernels.triton_flash``'s candidate lists) is marked.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import sys

import torch

from benchmarks import cuda_missing
from benchmarks.attention import emit, parse_mode, parse_shape

FWD_TILES = [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)]
DKDV_TILES = [(16, 64), (16, 128), (32, 64), (32, 128), (64, 64), (64, 128), (128, 128)]
DQ_TILES = [(64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64), (128, 128)]
WARPS, STAGES = (4, 8), (2, 3, 4)
KERNELS = ("fwd", "dkdv", "dq")


def candidates(kernel: str, paper_tile: int) -> list[dict]:
    tiles = {"fwd": FWD_TILES, "dkdv": DKDV_TILES, "dq": DQ_TILES}[kernel]
    out = []
    for (bm, bn), w, st in itertools.product(tiles, WARPS, STAGES):
        if kernel == "fwd" and paper_tile and bn > paper_tile:
            continue  # rounding=paper: a key block must not straddle two paper tiles
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st))
    return out


def prepare(shape, mode: str, autotune: bool = True):
    """The four launches of one fwd+bwd at shape (B, H, T, D), bf16 causal, in model layout; delta is filled.
    ``autotune`` False: the launches' own configuration is the fixed one (no timing on the first call)."""
    from kernels import triton_flash as tf
    from kernels.modes import AttentionSettings

    rounding, fix = mode.split("/")
    b, h, t, d = shape
    q, k, v, d_out = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                      for _ in range(4))
    settings = AttentionSettings(rounding=rounding, fix=fix, backend="triton", autotune=autotune)
    nm = tf.prepare(q, k, v, settings)
    fwd, out, lse, o32, _ = tf._forward_launch(q, k, v, settings, nm)
    fwd()
    saved = o32 if nm.keeps_fp32_output else out
    (delta, dkdv, dq), _ = tf._backward_launches(d_out, q, k, v, saved, lse, settings, nm)
    delta()
    return {"fwd": fwd, "delta": delta, "dkdv": dkdv, "dq": dq}, nm


def _compile_worker(args):
    shape, mode, jobs = args
    launches, _ = prepare(shape, mode, autotune=False)  # the workers only compile
    for kernel, cfg in jobs:
        try:
            launches[kernel].with_config(cfg)
        except Exception:  # noqa: BLE001 - does not fit; the timing pass reports it
            pass
    torch.cuda.synchronize()


def sweep(shape, mode: str, jobs: int, rep_ms: int, log):
    import triton

    from kernels import triton_flash as tf

    launches, nm = prepare(shape, mode)
    work = [(kernel, cfg) for kernel in KERNELS for cfg in candidates(kernel, nm.paper_tile)]
    if jobs > 1:
        log(f"compiling {len(work)} configurations in {jobs} processes")
        chunks = [(shape, mode, work[i::jobs]) for i in range(jobs)]
        with mp.get_context("spawn").Pool(jobs) as pool:
            pool.map(_compile_worker, chunks)
    # the autotuner's choice for this shape (tunes on the first call)
    launches["fwd"]()
    launches["dkdv"]()
    launches["dq"]()
    chosen = {kernel: getattr(tf, kernel.upper()).chosen.get(launches[kernel].tune_key) for kernel in KERNELS}
    results = {kernel: [] for kernel in KERNELS}
    for kernel, cfg in work:
        launch = launches[kernel]
        try:
            launch.with_config(cfg)
            ms = triton.testing.do_bench_cudagraph(lambda: launch.with_config(cfg), rep=rep_ms, return_mode="median")
        except Exception as err:  # noqa: BLE001
            log(f"{kernel} {cfg}: does not run ({type(err).__name__})")
            ms = float("nan")
        mark = chosen[kernel] is not None and all(chosen[kernel].get(n) == cfg[n] for n in cfg)
        results[kernel].append((ms, cfg, mark))
        log(f"{kernel} {cfg}: {ms * 1e3:.1f} us{' (autotuner choice)' if mark else ''}")
    delta_ms = triton.testing.do_bench_cudagraph(launches["delta"], rep=rep_ms, return_mode="median")
    return results, delta_ms, chosen


def to_markdown(results, delta_ms, shape, mode, top: int) -> str:
    import math

    lines = [f"Kernel time per launch (CUDA graph, median) on {torch.cuda.get_device_name()}, shape "
             f"{','.join(map(str, shape))} bf16 causal, mode {mode}; delta kernel {delta_ms * 1e3:.1f} us.", ""]
    best_total, chosen_total = delta_ms, delta_ms
    for kernel, rows in results.items():
        ok = sorted((r for r in rows if not math.isnan(r[0])), key=lambda r: r[0])
        lines += [f"**{kernel}** ({len(ok)} of {len(rows)} configurations run)", "",
                  "| rank | BLOCK_M x BLOCK_N | warps | stages | us | |", "|---|---|---|---|---|---|"]
        for rank, (ms, cfg, mark) in enumerate(ok):
            if rank < top or mark:
                lines.append(f"| {rank + 1} | {cfg['BLOCK_M']} x {cfg['BLOCK_N']} | {cfg['num_warps']} | "
                             f"{cfg['num_stages']} | {ms * 1e3:.1f} | {'autotuner choice' if mark else ''} |")
        lines.append("")
        if ok:
            best_total += ok[0][0]
            chosen_total += next((ms for ms, _, mark in ok if mark), math.nan)
    lines.append(f"Sum of the kernels' times: best configurations {best_total * 1e3:.1f} us, the autotuner's "
                 f"choices {chosen_total * 1e3:.1f} us.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_tiles", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8,12,1024,64", type=parse_shape, help="B,H,T,D (default 8,12,1024,64)")
    parser.add_argument("--mode", default="fa2/none", type=parse_mode, help="ROUNDING/FIX (default fa2/none)")
    parser.add_argument("--jobs", type=int, default=8, help="compile processes (default 8; 1 = compile inline)")
    parser.add_argument("--rep-ms", type=int, default=20, help="timed milliseconds per configuration (default 20)")
    parser.add_argument("--top", type=int, default=6, help="rows per kernel in the table (default 6)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    if cuda_missing("benchmarks.attention_tiles"):
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    results, delta_ms, _ = sweep(args.shape, args.mode, max(1, args.jobs), args.rep_ms, log)
    emit(to_markdown(results, delta_ms, args.shape, args.mode, args.top), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
