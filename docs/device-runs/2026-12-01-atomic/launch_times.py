"""GPU time of each backward launch (replayed as a CUDA graph), autotuned, for the deterministic backward (delta,
dK/dV, dQ) with dQ's k/v through TMA or pointers, and for the atomic backward (delta, dK/dV with atomic dQ through
a TMA reduction or pointer atomics, dQ finish), in the model's (B, T, H, D) layout and in contiguous (B, H, T, D).

    PYTHONPATH=. python docs/device-runs/2026-12-01-atomic/launch_times.py [B,H,T,D ...]
"""
import sys

import torch
import triton

from kernels import triton_flash as tf
from kernels.modes import check_args

VARIANTS = [("deterministic, dQ k/v via TMA", True, True), ("deterministic, dQ k/v via pointers", True, False),
            ("atomic dQ, TMA reduction", False, True), ("atomic dQ, pointer atomics", False, False)]


def times(shape, mode, layout, deterministic, tma):
    tf.set_tma(tma)
    b, h, t, d = shape
    if layout == "model":
        q, k, v, do = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    else:
        q, k, v, do = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    rounding, fix = mode.split("/")
    nm = check_args(q, k, v, rounding, fix, 2.0, 1e-3, (torch.bfloat16,))
    out, lse, _ = tf._forward(q, k, v, True, nm)
    launches, _ = tf._backward_launches(do, q, k, v, out, lse, True, nm, deterministic=deterministic)
    for launch in launches:
        launch()  # autotunes
    torch.cuda.synchronize()
    ms = [triton.testing.do_bench_cudagraph(launch, rep=30, return_mode="median") for launch in launches]
    cfg = [launch.kernel.chosen.get(launch.tune_key) for launch in launches]
    return ms, cfg


def main(shapes):
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for shape in shapes:
        for mode in ("fa2/none",):
            for layout in ("model", "contiguous"):
                for name, deterministic, tma in VARIANTS:
                    ms, cfg = times(shape, mode, layout, deterministic, tma)
                    parts = ", ".join(f"{x * 1e3:.0f}" for x in ms)
                    short = [None if c is None else (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
                             for c in cfg]
                    print(f"{shape} {mode} {layout:10s} {name:36s}: launches {parts} us = {sum(ms) * 1e3:.0f} us; "
                          f"tiles {short}", flush=True)
    tf.set_tma(False)


if __name__ == "__main__":
    main([tuple(int(x) for x in s.split(",")) for s in sys.argv[1:]] or [(4, 16, 4096, 128), (8, 12, 1024, 64)])
