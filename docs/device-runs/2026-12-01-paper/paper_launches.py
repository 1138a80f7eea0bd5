"""GPU time of the forward launch and of each backward launch (delta, dK/dV, dQ), each replayed as a CUDA graph and
autotuned, per mode, in the model's (B, T, H, D) layout: where rounding=paper spends its time against fa2.

    PYTHONPATH=<tree> python docs/device-runs/2026-12-01-paper/paper_launches.py [B,H,T,D ...]

<tree> is the repository whose kernels are timed (this one, or an older checkout, to compare two versions in one
device call); the script itself only uses kernels.triton_flash's launch helpers.
"""
import sys

import torch
import triton

from kernels import triton_flash as tf
from kernels.modes import check_args

MODES = ("fa2/none", "paper/none", "paper/dynamic_max", "fa2/dynamic_max")


def times(shape, mode):
    b, h, t, d = shape
    q, k, v, do = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    rounding, fix = mode.split("/")
    nm = check_args(q, k, v, rounding, fix, 2.0, 1e-3, (torch.bfloat16,))
    fwd = tf._forward_launch(q, k, v, True, nm)[0]
    out, lse, _ = tf._forward(q, k, v, True, nm)
    launches, _ = tf._backward_launches(do, q, k, v, out, lse, True, nm)
    launches = [fwd, *launches]
    for launch in launches:
        launch()  # autotunes
    torch.cuda.synchronize()
    ms = [triton.testing.do_bench_cudagraph(launch, rep=30, return_mode="median") for launch in launches]
    cfg = [launch.kernel.chosen.get(launch.tune_key) for launch in launches]
    return ms, cfg


def main(shapes):
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"kernels from {tf.__file__}", flush=True)
    for shape in shapes:
        for mode in MODES:
            ms, cfg = times(shape, mode)
            short = [None if c is None else (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
                     for c in cfg]
            print(f"{shape} {mode:18s}: fwd {ms[0] * 1e3:.0f} us; bwd {' + '.join(f'{x * 1e3:.0f}' for x in ms[1:])}"
                  f" = {sum(ms[1:]) * 1e3:.0f} us; total {sum(ms) * 1e3:.0f} us; tiles {short}", flush=True)


if __name__ == "__main__":
    main([tuple(int(x) for x in s.split(",")) for s in sys.argv[1:]] or [(8, 12, 1024, 64), (4, 16, 4096, 128)])
