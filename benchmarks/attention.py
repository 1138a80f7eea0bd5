"""Attention speed on the GPU: every rounding x fix mode of the kernels next to torch SDPA (flash, cuDNN).

    python -m benchmarks.attention [--shapes 8,12,1024,64 ...] [--modes fa2/none ...] [--atomic-dq]
        [--backends triton gluon auto] [--out FILE.md]

Causal, bf16. TFLOP/s from FLOPs fwd = 2 * 2 * B H T^2 D / 2 and fwd+bwd = 3.5 x that; times are medians of
``triton.testing.do_bench`` (eager: host overhead included) and of ``do_bench_cudagraph`` (the same forward, and
fwd+bwd, replayed as a CUDA graph: GPU time, the kernels' own speed); the ratios are of the GPU times. Before
timing, each mode's output and gradients (with the autotuned configurations) are checked against SDPA (relative
error of a bf16 kernel, 2e-2 allowed for paper rounding). The Triton kernels are autotuned on the first call of
every shape; the Gluon kernel (``--backends gluon``: by name, fixed tiles) takes the modes it implements and hands
the others to the Triton kernel, saying so once.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from benchmarks import cuda_missing

SHAPES = [(8, 12, 1024, 64), (4, 16, 4096, 64), (2, 16, 4096, 128), (1, 32, 8192, 128)]
ATOMIC = " atomic-dQ"  # the name suffix of a mode run with the atomic dQ backward (--atomic-dq)


def parse_shape(text: str):
    """argparse type of a B,H,T,D attention shape (shared by the attention benchmarks)."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} must be B,H,T,D with positive integers, e.g. 8,12,1024,64")
    return shape


def _modes():
    from kernels import FIXES, ROUNDINGS

    return [f"{r}/{f}" for r in ROUNDINGS for f in FIXES]


def parse_mode(text: str) -> str:
    """argparse type of a ROUNDING/FIX kernel mode."""
    if text not in _modes():
        raise argparse.ArgumentTypeError(f"mode {text!r} is not one of {', '.join(_modes())}")
    return text


def emit(table: str, out: str | None) -> None:
    """Print a markdown table and, if asked, write it to a file too."""
    print(table)
    if out:
        with open(out, "w") as fh:
            fh.write(table)


def flops(b, h, t, d):
    fwd = 2 * 2 * b * h * t * t * d / 2
    return fwd, 3.5 * fwd


def bench(fn, rep_ms: int) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median")


def sdpa_fn(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def measure(fn, q, k, v, d_out, rep_ms):
    """(eager fwd ms, fwd ms replayed as a CUDA graph, eager fwd+bwd ms, fwd+bwd ms as a CUDA graph) of fn (eager
    times include the host's: the Gluon kernel's launch path through Triton's JIT entry point measured 0.2-0.4 ms
    per fwd+bwd, docs/attention-kernel.md), on fresh leaf copies of q, k, v: an
    autograd node left over from an earlier timing (its AccumulateGrad on the default stream) broke the capture of
    the next one at (4,16,4096,128) on the H200 (device runs of 2026-12-02)."""
    import triton

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def fwd():
        with torch.no_grad():
            fn(q, k, v)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(d_out)

    def grads():
        return torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)

    grads()  # compile / autotune outside the timing
    fwd()
    torch.cuda.synchronize()
    graph_ms = triton.testing.do_bench_cudagraph(grads, rep=rep_ms, return_mode="median")  # before any .grad exists
    fwd_graph_ms = triton.testing.do_bench_cudagraph(fwd, rep=rep_ms, return_mode="median")
    fwd_bwd()
    return bench(fwd, rep_ms), fwd_graph_ms, bench(fwd_bwd, rep_ms), graph_ms


def breakdown(q, k, v, d_out, rep_ms, log, shape, deterministic: bool = True):
    """Time of each launch of fa2/none (forward; delta, dK/dV, dQ of the backward) and of the Python/autograd path,
    to tell kernel time from host overhead; ``deterministic`` False: the atomic dQ backward."""
    import kernels
    from kernels import ops
    from kernels import triton_flash as tf
    from kernels.modes import AttentionSettings

    settings = AttentionSettings(backend="triton", deterministic=deterministic)
    fields = ops.settings_fields(settings)
    nm = tf.prepare(q, k, v, settings)
    with torch.no_grad():
        out, lse, _, _ = tf.forward(q, k, v, settings, nm)
    t_fwd = bench(lambda: tf.forward(q, k, v, settings, nm), rep_ms)
    t_bwd = bench(lambda: tf.backward(d_out, q, k, v, out, lse, None, settings, nm), rep_ms)
    t_op = bench(lambda: ops.flash_bwd(d_out, q, k, v, out, lse, None, None, "triton", *fields), rep_ms)

    def op_step():  # fwd+bwd through the torch custom ops (the path torch.compile sees; eager used it before)
        q.grad = k.grad = v.grad = None
        ops.flash_fwd(q, k, v, None, "triton", *fields)[0].backward(d_out)

    def eager_step():
        q.grad = k.grad = v.grad = None
        kernels.attention(q, k, v, settings).backward(d_out)

    t_op_step = bench(op_step, rep_ms)
    t_eager_step = bench(eager_step, rep_ms)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        tf.backward(d_out, q, k, v, out, lse, None, settings, nm)
    host = (time.perf_counter() - t0) / 20 * 1e3  # no sync inside: host time per call if it exceeds the GPU's
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        eager_step()
    host_step = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    fwd_launch = tf._forward_launch(q, k, v, settings, nm)[0]
    (_, dkdv_launch, dq_launch), _ = tf._backward_launches(d_out, q, k, v, out, lse, settings, nm)
    cfg = {name: str(launch.kernel.chosen.get(launch.tune_key, "not tuned"))
           for name, launch in (("fwd", fwd_launch), ("dkdv", dkdv_launch), ("dq", dq_launch))}
    name = "fa2/none" if deterministic else "fa2/none" + ATOMIC
    log(f"{shape} {name} breakdown: fwd launch {t_fwd:.3f} ms, bwd launches {t_bwd:.3f} ms, bwd custom op "
        f"{t_op:.3f} ms, bwd host-issue time {host:.3f} ms/call; fwd+bwd step eager {t_eager_step:.3f} ms vs via "
        f"custom ops {t_op_step:.3f} ms, eager step host-issue time {host_step:.3f} ms/call; configs {cfg}")


def run(shapes, modes, rep_ms, log, atomic_dq: bool = False, backends=("triton",)):
    """Rows of the table; ``atomic_dq``: each mode also with the atomic (non-deterministic) dQ backward;
    ``backends``: the implementations timed (triton, gluon, auto: kernels.implementation's choice), rows named
    ``BACKEND MODE`` but for triton's."""
    from torch.nn.attention import SDPBackend

    import kernels

    rows = []
    for shape in shapes:
        b, h, t, d = shape
        f_fwd, f_all = flops(*shape)
        q, k, v, d_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        results = {}
        baseline = None
        ref_grads = None
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            fn = sdpa_fn(backend)
            try:
                if baseline is None:
                    with torch.no_grad():
                        baseline = fn(q, k, v).float()
                    q.grad = k.grad = v.grad = None
                    fn(q, k, v).backward(d_out)
                    ref_grads = [x.grad.float() for x in (q, k, v)]
                results[name] = measure(fn, q, k, v, d_out, rep_ms)
            except RuntimeError as exc:  # a backend torch cannot run here
                log(f"{shape} {name}: unavailable ({str(exc).splitlines()[0][:100]})")
        for backend, mode, deterministic in [(b, m, d) for b in backends for m in modes
                                             for d in ((True, False) if atomic_dq else (True,))]:
            rounding, fix = mode.split("/")
            mode = mode if deterministic else mode + ATOMIC
            mode = mode if backend == "triton" else f"{backend} {mode}"  # the Triton kernel's rows keep their names
            t0 = time.time()

            settings = kernels.AttentionSettings(rounding=rounding, fix=fix, backend=backend,
                                                 deterministic=deterministic)

            def fn(q, k, v, settings=settings):  # one settings record for every call, as the model holds it
                return kernels.attention(q, k, v, settings)

            with torch.no_grad():
                out = fn(q, k, v).float()
            err = ((out - baseline).norm() / baseline.norm()).item()
            limit = 2e-2 if rounding == "paper" else 1e-2
            if not (err < limit):
                raise SystemExit(f"{shape} {mode}: output differs from SDPA by {err:.2e} (limit {limit}); not timing")
            q.grad = k.grad = v.grad = None
            fn(q, k, v).backward(d_out)  # autotunes the backward; its gradients are checked too
            gerr = max(((x.grad.float() - r).norm() / r.norm()).item() for x, r in zip((q, k, v), ref_grads))
            if not (gerr < 2 * limit):
                raise SystemExit(f"{shape} {mode}: gradients differ from SDPA by {gerr:.2e} (limit {2 * limit}); "
                                 "not timing")
            err = max(err, gerr)
            results[mode] = measure(fn, q, k, v, d_out, rep_ms)
            t_fwd, t_fwd_gpu, t_all, t_gpu = results[mode]
            log(f"{shape} {mode}: fwd {t_fwd:.3f} ms (eager), {t_fwd_gpu:.3f} ms (GPU), fwd+bwd {t_all:.3f} ms "
                f"(eager), {t_gpu:.3f} ms (GPU), rel err vs SDPA "
                f"(O and grads) {err:.1e} ({time.time() - t0:.0f} s with tuning)")
        if "fa2/none" in modes:
            breakdown(q, k, v, d_out, rep_ms, log, shape)
            if atomic_dq:
                breakdown(q, k, v, d_out, rep_ms, log, shape, deterministic=False)
        for name, times in results.items():
            rows.append((shape, name, *(f / t / 1e9 for f, t in zip((f_fwd, f_fwd, f_all, f_all), times))))
        del q, k, v, d_out
        torch.cuda.empty_cache()
    return rows


def to_markdown(rows, device: str) -> str:
    """The table of ``run``'s rows (shape, name, then TFLOP/s of: the eager forward, the forward's GPU time, eager
    fwd+bwd, fwd+bwd GPU time); every ratio is of GPU times."""
    by_shape = {}
    for shape, name, *rates in rows:
        by_shape.setdefault(shape, {})[name] = rates
    lines = [f"Attention benchmark on {device}, torch {torch.__version__}, causal bf16 (TFLOP/s; ratios of the GPU "
             "times).", "", "| B,H,T,D | impl | fwd TFLOP/s eager | fwd TFLOP/s GPU | fwd / SDPA cuDNN "
             "| fwd+bwd TFLOP/s eager | fwd+bwd TFLOP/s GPU | / SDPA flash | / SDPA cuDNN "
             "| / same rounding, fix=none |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    none = (None,) * 4
    for shape, res in by_shape.items():
        cudnn_fwd, cudnn = res.get("sdpa-cudnn", none)[1], res.get("sdpa-cudnn", none)[3]
        flash = res.get("sdpa-flash", none)[3]
        for name, (tf_fwd, tf_fwd_gpu, tf_all, tf_gpu) in res.items():
            ratio = lambda value, ref: f"{value / ref:.2f}" if ref else "-"  # noqa: E731
            suffix = ATOMIC if name.endswith(ATOMIC) else ""
            base = res.get(name.split("/")[0] + "/none" + suffix, none)[3] if "/" in name else None
            lines.append(f"| {','.join(map(str, shape))} | {name} | {tf_fwd:.0f} | {tf_fwd_gpu:.0f} | "
                         f"{ratio(tf_fwd_gpu, cudnn_fwd)} | {tf_all:.0f} | {tf_gpu:.0f} | {ratio(tf_gpu, flash)} | "
                         f"{ratio(tf_gpu, cudnn)} | {ratio(tf_gpu, base)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES, metavar="B,H,T,D",
                        help="shapes to time (default: the four of the issue)")
    parser.add_argument("--modes", nargs="+", default=None, metavar="ROUNDING/FIX",
                        help="kernel modes (default: all eight)")
    parser.add_argument("--rep-ms", type=int, default=200, help="milliseconds of timed repetitions (default 200)")
    parser.add_argument("--atomic-dq", action="store_true",
                        help="time each mode also with the atomic dQ backward (flash_attention(..., "
                             "deterministic=False); rows named MODE atomic-dQ)")
    parser.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "gluon", "auto"],
                        help="implementations to time (default triton; gluon: the Hopper kernel by name, auto: "
                             "kernels.implementation's choice)")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    modes = args.modes or _modes()
    unknown = [m for m in modes if m not in _modes()]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {_modes()}")
    if cuda_missing("benchmarks.attention"):
        return 2
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    import triton

    log(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rows = run(args.shapes, modes, args.rep_ms, log, args.atomic_dq, args.backends)
    emit(to_markdown(rows, torch.cuda.get_device_name()), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
