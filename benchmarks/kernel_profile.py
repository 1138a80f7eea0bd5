"""Where attention's GPU time goes, kernel by kernel: one fwd+bwd step of SDPA cuDNN and of this project's kernels.

    python -m benchmarks.kernel_profile [--shapes 8,12,1024,64 ...] [--modes fa2/none fa2/fp32_output]
        [--backends gluon triton auto] [--atomic-dq] [--steps 10] [--out FILE.md]

For SDPA cuDNN and each backend x mode (x dQ order with ``--atomic-dq``), every kernel one causal bf16 fwd+bwd step
launches, with its launches and GPU time per step (torch.profiler's CUDA activity over ``--steps`` eager steps
after one untimed step: the kernels' own time, no host time) and its share of the step's kernel time. It answers
what a single ratio cannot: how much of a backward lies outside its main kernel (the delta pass, the zeroing of
dQ's FP32 buffer, dQ's final rounding) and what cuDNN launches against it. ``benchmarks.attention`` gives the
end-to-end ratios. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import cuda_missing
from benchmarks.attention import ATOMIC, emit, parse_mode, parse_shape
from benchmarks.train_speed import kernel_times

SHAPES = [(8, 12, 1024, 64), (4, 16, 2048, 128), (4, 16, 4096, 128)]  # GPT-2 small, the 1.3B recipe, a long one


def per_step(kernels: dict[str, tuple[float, int]], steps: int) -> list[tuple[str, float, float]]:
    """(kernel, launches per step, us per step), the longest first, from ``kernel_times`` over ``steps`` steps."""
    rows = [(name, count / steps, us / steps) for name, (us, count) in kernels.items()]
    return sorted(rows, key=lambda row: -row[2])


def to_markdown(shape, impl: str, rows: list[tuple[str, float, float]]) -> str:
    """One implementation's kernels at one shape as markdown table rows (with a total row)."""
    total = sum(us for _, _, us in rows) or 1.0
    label = ",".join(str(x) for x in shape)
    lines = [f"| {label} | {impl} | `{name[:90]}` | {n:g} | {us:,.1f} | {100 * us / total:.1f}% |"
             for name, n, us in rows]
    lines.append(f"| {label} | {impl} | **all kernels** | {sum(n for _, n, _ in rows):g} | **{total:,.1f}** | "
                 "100% |")
    return "\n".join(lines)


def implementations(modes, backends, atomic_dq: bool):
    """[(name, fn(q, k, v) -> O)]: SDPA cuDNN first, then each backend x mode (x dQ order)."""
    import kernels
    from kernels.modes import AttentionSettings
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    impls = [("sdpa-cudnn", cudnn)]
    for backend in backends:
        for mode in modes:
            rounding, fix = mode.split("/")
            for deterministic in (True, False) if atomic_dq else (True,):
                settings = AttentionSettings(rounding=rounding, fix=fix, backend=backend, deterministic=deterministic)
                name = f"{backend} {mode}" + ("" if deterministic else ATOMIC)
                impls.append((name, lambda q, k, v, settings=settings: kernels.attention(q, k, v, settings)))
    return impls


def profile_impl(fn, shape, steps: int) -> list[tuple[str, float, float]]:
    """Per-step kernels of ``steps`` profiled fwd+bwd steps of ``fn`` at ``shape`` (fresh inputs, model layout)."""
    from torch.profiler import ProfilerActivity, profile

    b, h, t, d = shape
    q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    d_out = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)

    step()  # compilation, autotuning, caches
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return per_step(kernel_times(prof, on_gpu=True), steps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernel_profile", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES, metavar="B,H,T,D",
                        help="causal attention shapes (default: (8,12,1024,64) (4,16,2048,128) (4,16,4096,128))")
    parser.add_argument("--modes", nargs="+", type=parse_mode, default=["fa2/none", "fa2/fp32_output"],
                        metavar="ROUNDING/FIX", help="kernel modes (default: fa2/none fa2/fp32_output)")
    parser.add_argument("--backends", nargs="+", default=["gluon"], choices=["triton", "gluon", "auto"],
                        help="this project's implementations (default gluon: the Hopper kernel by name)")
    parser.add_argument("--atomic-dq", action="store_true", help="each mode also with the atomic dQ backward")
    parser.add_argument("--steps", type=int, default=10, help="profiled fwd+bwd steps per row (default 10)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if cuda_missing("benchmarks.kernel_profile", "it reads the kernels' GPU time"):
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", file=sys.stderr, flush=True)
    blocks = ["| B,H,T,D | implementation | kernel | launches per step | us per step | share |",
              "|---|---|---|---|---|---|"]
    for shape in args.shapes:
        for name, fn in implementations(args.modes, args.backends, args.atomic_dq):
            try:
                rows = profile_impl(fn, shape, args.steps)
            except Exception as exc:  # one failing implementation should not hide the others' rows
                print(f"{shape} {name}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
                continue
            blocks.append(to_markdown(shape, name, rows))
            print(f"{shape} {name}: {sum(us for _, _, us in rows):,.1f} us of kernels per step", file=sys.stderr,
                  flush=True)
    emit("\n".join(blocks) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
