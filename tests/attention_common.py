"""Helpers shared by the attention tests (reference, interpreter and GPU tiers)."""

import math

import torch

import kernels

MODES = [(r, f) for r in kernels.ROUNDINGS for f in kernels.FIXES]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp64_out_and_grads(q, k, v, d_out, causal):
    """Exact softmax attention in fp64 of the same (LP) inputs, k/v heads repeated for GQA; gradients of
    sum(O * d_out) when d_out is given, else None."""
    qq, kk, vv = (t.detach().double().requires_grad_(d_out is not None) for t in (q, k, v))
    rep = qq.shape[1] // kk.shape[1]
    s = (qq @ kk.repeat_interleave(rep, 1).transpose(-1, -2)) / math.sqrt(qq.shape[-1])
    if causal:
        t = qq.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ vv.repeat_interleave(rep, 1)
    if d_out is None:
        return out.detach(), None
    out.backward(d_out.double())
    return out.detach(), [qq.grad, kk.grad, vv.grad]
