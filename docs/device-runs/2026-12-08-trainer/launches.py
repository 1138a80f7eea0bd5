"""Where fwd+bwd's GPU time goes, launch by launch (prepared 2026-12-08 for a device call): for SDPA cuDNN and the
Gluon kernel (fa2/none and fa2/fp32_output with ordered dQ, fa2/none with atomic dQ), the GPU time of every kernel
one fwd+bwd step launches, from the CUDA profiler (torch.profiler, eager steps, averaged over --rep steps).

The question it answers: how much of our backward is outside the fused kernel (the delta launch, the zeroing of
dQ's FP32 buffer, dQ's final scale and rounding) against what cuDNN launches, i.e. what fusing them could win.

    PYTHONPATH=. python docs/device-runs/2026-12-08-trainer/launches.py [--shapes 8,12,1024,64 ...] [--rep 10]
"""
import argparse
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_spec = importlib.util.spec_from_file_location("probe_d64", Path(__file__).parent.parent / "2026-12-06-d64/probe.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)


def cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


IMPLS = {
    "sdpa-cudnn": cudnn,
    "gluon none det": lambda q, k, v: base.gluon(q, k, v, True, "none", True),
    "gluon fp32_output det": lambda q, k, v: base.gluon(q, k, v, True, "fp32_output", True),
    "gluon none atomic": lambda q, k, v: base.gluon(q, k, v, True, "none", False),
}


def kernel_times(step, rep: int) -> dict:
    """{kernel name: (launches per step, GPU us per step)} over ``rep`` profiled steps (after one unprofiled)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rep):
            step()
        torch.cuda.synchronize()
    calls, micros = defaultdict(int), defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        calls[event.name] += 1
        micros[event.name] += event.time_range.elapsed_us()
    return {name: (calls[name] / rep, micros[name] / rep) for name in calls}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["8,12,1024,64", "4,16,2048,128", "4,16,4096,128"])
    p.add_argument("--rep", type=int, default=10)
    a = p.parse_args()
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()}", flush=True)
    for shape in a.shapes:
        b, h, t, d = (int(x) for x in shape.split(","))
        for impl, fn in IMPLS.items():
            q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                       for _ in range(3))
            d_out = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
            try:
                times = kernel_times(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), d_out), a.rep)
            except Exception as exc:  # one broken impl should not hide the others
                print(f"{shape} {impl}: ERR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            total = sum(us for _, us in times.values())
            print(f"\n{shape} {impl}: {total:.0f} us of kernels per fwd+bwd step", flush=True)
            for name, (n, us) in sorted(times.items(), key=lambda kv: -kv[1][1]):
                print(f"  {us:8.1f} us {100 * us / total:5.1f}%  x{n:g}  {name[:110]}", flush=True)
            del q, k, v, d_out
    return 0


if __name__ == "__main__":
    sys.exit(main())
