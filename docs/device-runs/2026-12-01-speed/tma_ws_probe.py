"""Probe (issue 22): do TMA tensor descriptors and Triton's warp specialisation speed up this repo's fa2/none
kernels on the H200? Minimal copies of the product kernels' fa2/none causal math (forward; dK/dV; dQ) whose loads go
through host-side 4-D tensor descriptors, with and without ``tl.range(..., warp_specialize=True)``, timed per launch
in a CUDA graph next to the product kernels (autotuned) and SDPA's cuDNN and flash kernels (torch profiler).

    PYTHONPATH=. python docs/device-runs/2026-12-01-speed/tma_ws_probe.py
"""
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks import attention_tiles as at

LOG2E = 1.4426950408889634
# call 1 tried both; warp specialisation never helped (and fails to compile with 4 warps), so later calls skip it
WS_CHOICES = (False,) if "--no-ws" in sys.argv else (False, True)


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, desc_k, desc_v, b, hk, offs_m, lo, hi, exp_scale, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where(offs_m[:, None] >= (start_n + offs_n)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2((s - m_new[:, None]) * exp_scale)
        alpha = tl.exp2((m_i - m_new) * exp_scale)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_tma(desc_q, desc_k, desc_v, desc_o, LSE, H, T, exp_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, WS: tl.constexpr):
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = desc_q.load([b, h, start_m * BLOCK_M, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_hi = start_m * BLOCK_M
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, desc_k, desc_v, b, h, offs_m, 0, full_hi, exp_scale, BLOCK_N,
                              HEAD_DIM, False, WS)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, desc_k, desc_v, b, h, offs_m, full_hi, full_hi + BLOCK_M, exp_scale,
                              BLOCK_N, HEAD_DIM, True, WS)
    o = tl.math.div_rn(acc, l_i[:, None])
    desc_o.store([b, h, start_m * BLOCK_M, 0], o.to(tl.bfloat16).reshape(1, 1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + bh * T + offs_m, (m_i * exp_scale + tl.log2(l_i)) * 0.6931471805599453)


@triton.jit
def _dkdv_loop(dk, dv, k, v, desc_q, desc_do, lse_base, delta_base, b, h, cols, lo, hi, exp_scale,
               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WS):
        rows = start_m + offs_m
        q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = desc_do.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        lse = tl.load(lse_base + rows)
        delta = tl.load(delta_base + rows)
        pt = tl.exp2(tl.dot(k, tl.trans(q)) * exp_scale - (lse * 1.4426950408889634)[None, :])
        if MASKED:
            pt = tl.where(rows[None, :] >= cols[:, None], pt, 0.0)
        dv = tl.dot(pt.to(tl.bfloat16), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(tl.bfloat16), q, dk)
    return dk, dv


@triton.jit
def dkdv_tma(desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, LSE, DELTA, H, T, exp_scale, sm_scale,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = start_n + tl.arange(0, BLOCK_N)
    k = desc_k.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = desc_v.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    m_lo = (start_n // BLOCK_M) * BLOCK_M
    m_diag = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, LSE + bh * T, DELTA + bh * T, b, h, cols, m_lo, m_diag,
                        exp_scale, BLOCK_M, HEAD_DIM, True, WS)
    dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, LSE + bh * T, DELTA + bh * T, b, h, cols, m_diag, T,
                        exp_scale, BLOCK_M, HEAD_DIM, False, WS)
    desc_dk.store([b, h, start_n, 0], (dk * sm_scale).to(tl.bfloat16).reshape(1, 1, BLOCK_N, HEAD_DIM))
    desc_dv.store([b, h, start_n, 0], dv.to(tl.bfloat16).reshape(1, 1, BLOCK_N, HEAD_DIM))


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, desc_k, desc_v, b, h, rows, lo, hi, exp_scale, BLOCK_N: tl.constexpr,
             HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = desc_v.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * exp_scale - lse2[:, None])
        if MASKED:
            p = tl.where(rows[:, None] >= (start_n + offs_n)[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(tl.bfloat16), k, dq)
    return dq


@triton.jit
def dq_tma(desc_q, desc_k, desc_v, desc_do, desc_dq, LSE, DELTA, H, T, exp_scale, sm_scale, HEAD_DIM: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = start_m + tl.arange(0, BLOCK_M)
    q = desc_q.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = desc_do.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    lse2 = tl.load(LSE + bh * T + rows) * 1.4426950408889634
    delta = tl.load(DELTA + bh * T + rows)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_hi = (start_m // BLOCK_N) * BLOCK_N
    dq = _dq_loop(dq, q, do, lse2, delta, desc_k, desc_v, b, h, rows, 0, full_hi, exp_scale, BLOCK_N, HEAD_DIM, False,
                  WS)
    dq = _dq_loop(dq, q, do, lse2, delta, desc_k, desc_v, b, h, rows, full_hi, start_m + BLOCK_M, exp_scale, BLOCK_N,
                  HEAD_DIM, True, WS)
    desc_dq.store([b, h, start_m, 0], (dq * sm_scale).to(tl.bfloat16).reshape(1, 1, BLOCK_M, HEAD_DIM))


def desc(t, block):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block, t.shape[-1]])


def log(msg):
    print(msg, flush=True)


def probe(shape):
    b, h, t, d = shape
    launches, nm = at.prepare(shape, "fa2/none")  # product kernels, autotuned on first call (model layout)
    for name in ("fwd", "delta", "dkdv", "dq"):
        launches[name]()
    torch.cuda.synchronize()
    prod = {}
    for name in ("fwd", "delta", "dkdv", "dq"):
        prod[name] = triton.testing.do_bench_cudagraph(launches[name], rep=30, return_mode="median")
    log(f"{shape} product kernels (us): " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in prod.items()))
    q, k, v, out, o32, lse, keys = launches["fwd"].tensors
    _, _, _, d_out, _, delta, dk_ref, dv_ref = launches["dkdv"].tensors
    dq_ref = launches["dq"].tensors[-1]
    o_ref = out.clone()
    exp_scale = nm.exp_scale
    best = {}
    grid_rows = b * h
    tiles = {"fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
             "dkdv": [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (128, 128, 8, 2), (32, 128, 4, 3)],
             "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2)]}
    for kernel in ("fwd", "dkdv", "dq"):
        rows = []
        for (bm, bn, w, st), ws in itertools.product(tiles[kernel], WS_CHOICES):
            o = torch.empty_like(out)
            lse2 = torch.empty_like(lse)
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            if kernel == "fwd":
                fn = lambda: fwd_tma[(t // bm, grid_rows)](desc(q, bm), desc(k, bn), desc(v, bn), desc(o, bm), lse2, h,
                                                           t, exp_scale, d, bm, bn, ws, num_warps=w, num_stages=st)
                check = lambda: (o.float() - o_ref.float()).abs().max().item()
            elif kernel == "dkdv":
                fn = lambda: dkdv_tma[(t // bn, grid_rows)](desc(q, bm), desc(k, bn), desc(v, bn), desc(d_out, bm),
                                                            desc(dk, bn), desc(dv, bn), lse, delta, h, t, exp_scale,
                                                            nm.sm_scale, d, bm, bn, ws, num_warps=w, num_stages=st)
                check = lambda: max((dk.float() - dk_ref.float()).abs().max().item(),
                                    (dv.float() - dv_ref.float()).abs().max().item())
            else:
                fn = lambda: dq_tma[(t // bm, grid_rows)](desc(q, bm), desc(k, bn), desc(v, bn), desc(d_out, bm),
                                                          desc(dq, bm), lse, delta, h, t, exp_scale, nm.sm_scale, d,
                                                          bm, bn, ws, num_warps=w, num_stages=st)
                check = lambda: (dq.float() - dq_ref.float()).abs().max().item()
            try:
                fn()
                torch.cuda.synchronize()
                err = check()
                ms = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
            except Exception as exc:  # noqa: BLE001
                log(f"{shape} {kernel} tma {bm}x{bn} w{w} s{st} ws={ws}: fails ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:120] if str(exc) else ''})")
                continue
            rows.append((ms, (bm, bn, w, st, ws), err))
        rows.sort()
        for ws in WS_CHOICES:
            top = [r for r in rows if r[1][4] == ws][:3]
            for ms, c, err in top:
                log(f"{shape} {kernel} tma ws={ws} {c[0]}x{c[1]} w{c[2]} s{c[3]}: {ms * 1e3:.1f} us "
                    f"({prod[kernel] / ms:.2f}x product; max |diff| vs product {err:.2e})")
        best[kernel] = rows[0] if rows else None
    return prod, best


def mode_times(shape, modes):
    """GPU time of one fwd+bwd (the four product launches) per mode, in a CUDA graph."""
    for mode in modes:
        launches, _ = at.prepare(shape, mode)
        steps = [launches[n] for n in ("fwd", "delta", "dkdv", "dq")]
        run = lambda: [s() for s in steps]  # noqa: E731
        run()
        ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
        each = {n: triton.testing.do_bench_cudagraph(launches[n], rep=20, return_mode="median") * 1e3
                for n in ("fwd", "delta", "dkdv", "dq")}
        log(f"{shape} {mode}: fwd+bwd GPU time {ms * 1e3:.1f} us; launches " +
            ", ".join(f"{n} {t:.1f}" for n, t in each.items()))


def sdpa_profile(shape):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    b, h, t, d = shape
    q, k, v, do = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for _ in range(4))
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        def step():
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), do)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_time_total > 0:
                log(f"{shape} sdpa-{name} kernel {ev.key[:150]}: {ev.device_time_total / ev.count:.1f} us x "
                    f"{ev.count // 5}")


def main():
    log(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[1:] if not s.startswith("--")] or [(4, 16, 4096, 128), (2, 16, 4096, 128),
                                                                            (8, 12, 1024, 64)]
    for shape in shapes:
        sdpa_profile(shape)
        mode_times(shape, ["fa2/none", "fa2/fp32_output", "fa2/dynamic_max", "fa2/stochastic_output", "paper/none",
                           "paper/fp32_output"])
        probe(shape)


if __name__ == "__main__":
    main()
