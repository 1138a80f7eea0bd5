"""Helpers shared by the attention tests (reference, interpreter and GPU tiers)."""

import functools

import torch

import kernels
from kernels.reference import exact_attention

MODES = [(r, f) for r in kernels.ROUNDINGS for f in kernels.FIXES]
NAN = float("nan")


def nan_filled(fn, **keywords):
    """``fn`` (flash_attention, reference_attention, saved_output) with ``out_fill=NaN``: its output and gradient
    buffers start NaN-filled, so an element that no launch (or reference tile) writes shows up in the tests'
    finiteness and equality checks. ``keywords``: more arguments bound the same way (e.g. autotune=False)."""
    return functools.partial(fn, out_fill=NAN, **keywords)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp64_out_and_grads(q, k, v, d_out, causal):
    """Exact softmax attention in fp64 of the same (LP) inputs, k/v heads repeated for GQA; gradients of
    sum(O * d_out) when d_out is given, else None."""
    qq, kk, vv = (t.detach().double().requires_grad_(d_out is not None) for t in (q, k, v))
    out, _ = exact_attention(qq, kk, vv, causal)
    if d_out is None:
        return out.detach(), None
    out.backward(d_out.double())
    return out.detach(), [qq.grad, kk.grad, vv.grad]


def tied_maxima_inputs(batch: int, heads: int, kv_heads: int, seq: int, dim: int = 64, pool: int = 6,
                       dtype=torch.bfloat16):
    """Random q, k, v, dO (CPU, ``dtype``) in which nearly every query row's maximum score repeats inside a key tile.

    Every key of a (batch, k/v head) is one of ``pool`` random vectors, so each key vector occurs ~seq/pool times,
    in every tile; whichever wins a row's maximum is tied with its copies, and dynamic_max shifts that row. q, V and
    dO are plain Gaussian draws (fresh each call: seed torch's generator, e.g. with the ``seed`` fixture).
    """
    anchors = torch.randn(batch, kv_heads, pool, dim)
    index = torch.randint(pool, (batch, kv_heads, seq, 1)).expand(-1, -1, -1, dim)
    k = torch.gather(anchors, 2, index)
    q = torch.randn(batch, heads, seq, dim)
    v = torch.randn(batch, kv_heads, seq, dim)
    d_out = torch.randn(batch, heads, seq, dim)
    return tuple(t.to(dtype) for t in (q, k, v, d_out))


def head_slices(q, k, v, d_out, parts: int):
    """Split q/dO heads into ``parts`` contiguous slices and k/v heads into the matching slices (GQA groups stay
    whole). Returns [(q, k, v, d_out, head_offset)] with head_offset the slice's first q head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % parts or kv_heads % parts:
        raise ValueError(f"{heads} q heads and {kv_heads} k/v heads do not split into {parts} equal slices")
    hq, hk = heads // parts, kv_heads // parts
    return [(q[:, i * hq:(i + 1) * hq], k[:, i * hk:(i + 1) * hk], v[:, i * hk:(i + 1) * hk],
             d_out[:, i * hq:(i + 1) * hq], i * hq) for i in range(parts)]


def out_and_grads(fn, q, k, v, d_out, **kwargs):
    """fn(q, k, v, **kwargs) on fresh leaves (copies of q, k, v) and the gradients of sum(O * d_out)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def same_bits(a, b) -> bool:
    """Bit-for-bit equality (distinguishes -0.0 from 0.0 and compares NaN payloads)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(int_type),
                                                                      b.contiguous().view(int_type))


def assert_head_slices_match_whole(fn, q, k, v, d_out, parts: int = 2, msg: str = "", **kwargs):
    """Attention on all heads vs on ``parts`` head slices with their global head index (head_offset, total_heads):
    O, dq, dk and dv must be bit-identical. Then the last slice WITHOUT its offset must give another O (the
    numerics really depend on the head index, so the first check can fail). Returns the slices' outputs."""
    heads = q.shape[1]
    whole_out, whole_grads = out_and_grads(fn, q, k, v, d_out, **kwargs)
    sliced = [out_and_grads(fn, sq, sk, sv, sd, head_offset=off, total_heads=heads, **kwargs)
              for sq, sk, sv, sd, off in head_slices(q, k, v, d_out, parts)]
    cat_out = torch.cat([o for o, _ in sliced], dim=1)
    assert same_bits(whole_out, cat_out), f"{msg}: O of the head slices differs from the whole call"
    for i, name in enumerate(("dq", "dk", "dv")):
        cat_grad = torch.cat([g[i] for _, g in sliced], dim=1)
        assert same_bits(whole_grads[i], cat_grad), f"{msg}: {name} of the head slices differs from the whole call"
    sq, sk, sv, sd, _ = head_slices(q, k, v, d_out, parts)[-1]
    local_out, _ = out_and_grads(fn, sq, sk, sv, sd, **kwargs)
    assert not torch.equal(local_out, sliced[-1][0]), (
        f"{msg}: the last slice without head_offset/total_heads gave the same O: the inputs do not trigger the "
        "head-dependent shift, so the bit-identity check above proves nothing")
    return [o for o, _ in sliced]
