"""Pure-PyTorch flash attention with the kernel's tiling and rounding points: the ground truth for rounding on CPU.

The forward walks the key/value tiles in the kernel's order (an online softmax per query row) with every query row
at once: rows are independent, so the query tiling of the kernel (block_m) does not change a single bit of the
forward, and a tile without a valid key for a row (above the causal diagonal) is an exact no-op for that row. The
tiles are the rounding tiles of the mode: ``block_n`` keys (the kernel's key block) for fa2, ``paper_block_keys``
keys (512 as in the authors' code, or the whole row) for paper, whose kernel loops over smaller key blocks inside a
tile but rounds only at the tile's end.
All matrix products run in FP32 on LP-valued operands (the products are exact, like a tensor-core MMA); every
rounding to the LP dtype is explicit (``kernels.rounding.round_lp``).

Rounding points per mode (LP = input dtype, bf16 or fp16):

* ``fa2``: S = q.k in FP32 (the maximum is taken on it); P_bar = exp2((S - m) * scale*log2(e)) in FP32, rounded to LP
  for the P_bar V product; FP32 running O and row sum l; one final rounding of O = O_acc / l.
* ``paper`` (the authors' code under BF16 autocast), per tile of ``paper_block_keys`` keys: S = LP(LP(q.k) * scale);
  the tile max m from LP scores; P_bar = exp(LP(S - m)) in FP32; the tile product LP(LP(P_bar) V) (FP32 accumulate);
  alpha = exp(LP(m_old - m)); l = LP(alpha * l + rowsum(P_bar)) with the row sum in FP32; running
  O = LP(LP(O * alpha) + tile product); finally O = LP(O / l); LSE = m + log(l) in FP32.

Fixes change the per-tile, per-row maximum m (see ``_tile_max``) or, for ``fp32_output``, what the backward uses
for delta; the published rule also clamps each tile's row sum at ROW_SUM_FLOOR, as the authors' code does.
``stochastic_output`` replaces the final rounding of O by stochastic rounding to bf16 of the FP32 O (for paper: of
the FP32 shadow accumulation), keyed by (noise key of the batch row, global head, query position, channel). The
backward is the flash backward: P recomputed from the saved LSE, delta = rowsum(dO * O_saved); the delta-error
stress (``delta_gain`` != 1 or ``delta_sign="random"``) replaces it by delta_fp32 + gain * s * (delta - delta_fp32)
with delta_fp32 = rowsum(dO * O_fp32) of the same forward.
"""

from __future__ import annotations

import math

import torch

from kernels.modes import (FIX_EXACT_DELTA, FIX_FP32_OUTPUT, FIX_PUBLISHED, FIX_SAFE, KEY_TILE, ROW_SUM_FLOOR,
                           AttentionSettings, Numerics, check_args, check_heads)
from kernels.rounding import LN2, LOG2E, OUTPUT_SIGN_SALT, delta_signs, round_lp, safe_shift, stochastic_bf16

_REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tile_max(s: torch.Tensor, r_m: torch.Tensor, rows: torch.Tensor, bh: torch.Tensor, nm: Numerics,
              lp: torch.dtype, seen_max: torch.Tensor) -> torch.Tensor:
    """The maximum m that a score tile ``s`` (..., rows, cols) contributes to the online softmax, per row.

    ``rows``: global query indices; ``bh``: global (batch, head) indices b * total_heads + head_offset + h;
    ``seen_max``: the raw (unshifted) row maximum of the earlier tiles (-inf before the first).

    none / fp32_output: the row maximum r_m. dynamic_max_published (the paper's rule): with r_s = #{S : r_m - S <=
    eps}, m = beta*r_m if r_s > 1 and r_m > 0, m = 0 if r_s > 1 and r_m < 0, else r_m. dynamic_max (safe): m = r_m +
    delta for every tied row, delta in [2^-6, 2^-6 + 0.5) from ``safe_shift``; in fa2 rounding a row also counts as
    tied when r_m is within eps of ``seen_max`` (a repeated maximum split over tiles: the FP32 accumulator adds the
    tiles' exact ones and the final cast meets the same midpoint as within one tile). Fully masked rows (r_m = -inf)
    stay -inf.
    """
    if nm.fix not in (FIX_SAFE, FIX_PUBLISHED):
        return r_m
    r_s = ((r_m.unsqueeze(-1) - s) <= nm.eps_cmp).sum(-1)
    tied = r_s > 1
    if nm.fix == FIX_SAFE:
        if not nm.paper:
            tied = tied | ((r_m - seen_max).abs() <= nm.eps_cmp)
        return torch.where(tied, r_m + safe_shift(r_m, rows, bh) * nm.shift_scale, r_m)
    else:
        scaled = r_m * nm.beta
        if nm.paper:
            scaled = round_lp(scaled, lp)  # the authors compute beta * max in bf16
        m = torch.where(tied & (r_m > 0), scaled, r_m)
        return torch.where(tied & (r_m < 0), torch.zeros_like(r_m), m)


def _clamped_row_sum(p: torch.Tensor, r_m: torch.Tensor, nm: Numerics) -> torch.Tensor:
    """FP32 row sum of a tile's P_bar; the published rule clamps it at ROW_SUM_FLOOR like the authors' code, so a row
    whose every P_bar underflows ends with O = 0 instead of 0/0. Rows without a valid key in the tile (r_m = -inf)
    keep 0: the tile stays a no-op for them. (Under the other fixes a clamp could not change a bit: a tile's row sum
    is either >= 0.6, holding the running maximum's term, or added to an l >= 0.6.)"""
    row_sum = p.sum(-1)
    if nm.fix != FIX_PUBLISHED:
        return row_sum
    return torch.where(r_m > float("-inf"), row_sum.clamp_min(ROW_SUM_FLOOR), row_sum)


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat grouped k/v heads so that every q head has its own (GQA: q head h uses k/v head h // group)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


@torch.no_grad()
def forward_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, nm: Numerics, block_n: int,
                 kv_len: int | None = None, *, head_offset: int = 0, total_heads: int = 0,
                 noise_keys: torch.Tensor | None = None):
    """Tiled forward on LP tensors (k, v already expanded to q's heads); tiles of ``block_n`` keys for rounding=fa2,
    of ``nm.paper_tile`` keys (0: the whole row) for rounding=paper.

    q's head h is the model's head ``head_offset + h`` of ``total_heads`` (0: q.shape[1]); the safe fix's hash uses
    that global index, so a slice of the heads gives the same bits as the whole (tensor parallelism).

    Returns (O in LP dtype, LSE in FP32 natural log, O_fp32 or None). ``O_fp32`` (fix=fp32_output, the amplified
    delta path and the output stress: ``nm.keeps_fp32_output``, ``nm.output_amplified``) is the normalised output
    without its final rounding; for rounding=paper it
    is a shadow FP32 accumulation of the same per-tile products (before their rounding) with FP32 row sums.
    fix=stochastic_output: O = SR_bf16 of that FP32 O, keyed by ``noise_keys`` (batch,) (None: 0 for every row), the
    global head and the query position and channel. ``kv_len`` (testing only) masks keys >= kv_len.
    Fully masked rows give O = 0 and LSE = -inf. A row whose every P_bar underflows (the published rule at a large
    repeated maximum) has l = ROW_SUM_FLOOR from the clamp and O = 0, as in the authors' code.
    """
    lp = q.dtype
    bsz, heads, seq, dim = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    dev = q.device
    rows = torch.arange(seq, device=dev).view(1, 1, seq)
    total = check_heads(heads, head_offset, total_heads)
    bh = (torch.arange(bsz, device=dev).view(bsz, 1, 1) * total + head_offset
          + torch.arange(heads, device=dev).view(1, heads, 1))  # global index: hashed only, never used to address
    acc = torch.zeros(bsz, heads, seq, dim, device=dev)
    l_i = torch.zeros(bsz, heads, seq, device=dev)
    m_i = torch.full((bsz, heads, seq), float("-inf"), device=dev)
    seen_max = m_i.clone()  # raw row maximum of the tiles so far (the safe fix's cross-tile trigger in fa2)
    shadow = nm.shadow
    if shadow:
        acc32, l32 = torch.zeros_like(acc), torch.zeros_like(l_i)
    limit = seq if kv_len is None else kv_len
    tile = (nm.paper_tile or seq) if nm.paper else block_n
    for n0 in range(0, seq, tile):
        n1 = min(n0 + tile, seq)
        qk = qf @ kf[:, :, n0:n1].transpose(-1, -2)
        s = round_lp(round_lp(qk, lp) * nm.score_scale, lp) if nm.paper else qk
        cols = torch.arange(n0, n1, device=dev).view(1, 1, 1, -1)
        valid = cols < limit
        if causal:
            valid = valid & (cols <= rows.unsqueeze(-1))
        s = s.masked_fill(~valid, float("-inf"))
        r_m = s.amax(-1)
        m_new = torch.maximum(m_i, _tile_max(s, r_m, rows, bh, nm, lp, seen_max))
        seen_max = torch.maximum(seen_max, r_m)
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        vt = vf[:, :, n0:n1]
        if nm.paper:
            p = torch.exp2(round_lp(s - m_use.unsqueeze(-1), lp) * LOG2E)
            alpha = torch.exp2(round_lp(m_i - m_use, lp) * LOG2E)
            row_sum = _clamped_row_sum(p, r_m, nm)
            pv = round_lp(p, lp) @ vt
            l_i = round_lp(alpha * l_i + row_sum, lp)
            acc = round_lp(round_lp(acc * alpha.unsqueeze(-1), lp) + round_lp(pv, lp), lp)
            if shadow:
                acc32 = acc32 * alpha.unsqueeze(-1) + pv
                l32 = l32 * alpha + row_sum
        else:
            p = torch.exp2((s - m_use.unsqueeze(-1)) * nm.exp_scale)
            alpha = torch.exp2((m_i - m_use) * nm.exp_scale)
            l_i = l_i * alpha + _clamped_row_sum(p, r_m, nm)
            acc = acc * alpha.unsqueeze(-1) + round_lp(p, lp) @ vt
        m_i = m_new
    l_div = torch.where(l_i == 0, torch.ones_like(l_i), l_i)  # fully masked rows only: O = 0
    o_div = acc / l_div.unsqueeze(-1)
    o32 = acc32 / torch.where(l32 == 0, torch.ones_like(l32), l32).unsqueeze(-1) if shadow else o_div
    if nm.stochastic:  # the value rounded: the FP32 O (paper: its FP32 shadow), not the LP-accumulated one
        out = stochastic_bf16(o32, noise_keys, head_offset).to(lp)
    else:
        out = round_lp(o_div, lp).to(lp)
    if nm.paper:
        lse = m_i + torch.log2(l_i) * LN2
    else:
        lse = (m_i * nm.exp_scale + torch.log2(l_i)) * LN2
    if not (nm.keeps_fp32_output or nm.output_amplified):
        return out, lse, None
    return out, lse, o32


def _tile_probs(qf: torch.Tensor, kt: torch.Tensor, lse_s: torch.Tensor, n0: int, causal: bool, nm: Numerics,
                lp: torch.dtype) -> torch.Tensor:
    """The backward's P of the key tile starting at n0 (FP32, recomputed from LSE as in the forward's scores):
    exp2(S * exp_scale - LSE * log2(e)), one FMA per score in the kernel; 0 right of the causal diagonal.
    ``lse_s``: LSE * log2(e), (..., rows, 1)."""
    qk = qf @ kt.transpose(-1, -2)
    s = round_lp(round_lp(qk, lp) * nm.sm_scale, lp) if nm.paper else qk
    p = torch.exp2(s * nm.exp_scale - lse_s)
    if causal:
        rows = torch.arange(qf.shape[-2], device=qf.device).view(-1, 1)
        cols = torch.arange(n0, n0 + kt.shape[-2], device=qf.device).view(1, -1)
        p = p.masked_fill(cols > rows, 0.0)
    return p


@torch.no_grad()
def exact_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, lse: torch.Tensor,
                causal: bool, nm: Numerics, block_n: int) -> torch.Tensor:
    """delta_exact = rowsum(P * dP) / rowsum(P) (batch, heads, seq) in FP32, P the backward's own (``_tile_probs``),
    dP = dO V^T: one pass over the key tiles before the backward's, in its tile order (fix=exact_delta; the
    reference delta of delta_reference=exact). LP tensors, k and v expanded to q's heads.

    With exact P it is rowsum(dO * P V) = rowsum(dO * O_exact). Dividing by rowsum(P) makes it the delta of the
    backward's own P normalised, so that every row of dS = P (dP - delta) sums to 0 as the softmax's does: in fa2
    rowsum(P) is 1 up to FP32 rounding, but in paper rounding LSE holds the bf16 row sum l, so rowsum(P) =
    l_fp32 / l_bf16 is up to 2^-8 from 1, with the sign of l's rounding (l drops the small keys' weight: > 1), and the
    plain rowsum(P * dP) would carry that error into delta. FP32 error at most gamma(2n + head_dim) x
    sum_j P_j sum_c |dO_c V_jc| / rowsum(P) (n keys; tests/unit/test_attention_exact_delta.py derives and checks it).
    """
    lp = q.dtype
    qf, kf, vf, dof = q.float(), k.float(), v.float(), d_out.to(lp).float()
    lse_s = (lse * LOG2E).unsqueeze(-1)
    num = torch.zeros(lse.shape, device=q.device)
    den = torch.zeros(lse.shape, device=q.device)
    for n0 in range(0, q.shape[2], block_n):
        kt, vt = kf[:, :, n0:n0 + block_n], vf[:, :, n0:n0 + block_n]
        p = _tile_probs(qf, kt, lse_s, n0, causal, nm, lp)
        num = num + (p * (dof @ vt.transpose(-1, -2))).sum(-1)
        den = den + p.sum(-1)
    return num / torch.where(den == 0, torch.ones_like(den), den)  # den 0: a fully masked row (kv_len tests only)


@torch.no_grad()
def exact_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, causal: bool, nm: Numerics,
                 block_n: int) -> torch.Tensor:
    """P V / rowsum(P) in FP32 with the backward's own P: the O whose rowsum(dO * O) is ``exact_delta`` (up to the
    order of the FP32 sums), what ``saved_output`` returns for fix=exact_delta. LP tensors, k and v expanded."""
    lp = q.dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    lse_s = (lse * LOG2E).unsqueeze(-1)
    out = torch.zeros(qf.shape, device=q.device)
    den = torch.zeros(lse.shape, device=q.device)
    for n0 in range(0, q.shape[2], block_n):
        p = _tile_probs(qf, kf[:, :, n0:n0 + block_n], lse_s, n0, causal, nm, lp)
        out = out + p @ vf[:, :, n0:n0 + block_n]
        den = den + p.sum(-1)
    return out / torch.where(den == 0, torch.ones_like(den), den).unsqueeze(-1)


@torch.no_grad()
def backward_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_saved: torch.Tensor, lse: torch.Tensor,
                  d_out: torch.Tensor, causal: bool, nm: Numerics, block_n: int, *, o32: torch.Tensor | None = None,
                  noise_keys: torch.Tensor | None = None, head_offset: int = 0, out_fill: float | None = None):
    """Flash backward on LP tensors (k, v expanded to q's heads): returns FP32 dq, dk, dv.

    dk and dv are written key tile by key tile into buffers that start uninitialised, or filled with ``out_fill``
    (tests pass NaN, so that a tile the loop never writes shows up).

    P = exp(S - LSE) is recomputed per key tile (S = LP(LP(q.k) * scale) for rounding=paper, as in the forward; the
    paper tile size changes no bit of the backward);
    delta = rowsum(dO * O_saved) in FP32, or rowsum(P * dP) / rowsum(P) for fix=exact_delta (``exact_delta``, a
    first pass over the key tiles); on the amplified path ``delta_of`` combines it with delta_fp32 from ``o32`` or
    the exact pass;
    dS = P * (dP - delta) with dP = dO V^T; P and dS are rounded to LP
    as MMA operands: dV = LP(P)^T dO, dQ = scale * LP(dS) K, dK = scale * LP(dS)^T Q.
    """
    lp = q.dtype
    seq = q.shape[2]
    qf, kf, vf, dof = q.float(), k.float(), v.float(), d_out.to(lp).float()
    exact = exact_delta(q, k, v, d_out, lse, causal, nm, block_n) if nm.exact_pass else None
    delta = delta_of(dof, o_saved, nm, o32, noise_keys, head_offset, exact).unsqueeze(-1)
    lse_s = (lse * LOG2E).unsqueeze(-1)
    dq = torch.zeros_like(qf)
    dk, dv = (torch.empty_like(t) if out_fill is None else torch.full_like(t, out_fill) for t in (kf, vf))
    for n0 in range(0, seq, block_n):
        n1 = min(n0 + block_n, seq)
        kt, vt = kf[:, :, n0:n1], vf[:, :, n0:n1]
        p = _tile_probs(qf, kt, lse_s, n0, causal, nm, lp)
        dv[:, :, n0:n1] = round_lp(p, lp).transpose(-1, -2) @ dof
        dp = dof @ vt.transpose(-1, -2)
        ds = round_lp(p * (dp - delta), lp)
        dq += ds @ kt
        dk[:, :, n0:n1] = ds.transpose(-1, -2) @ qf
    return dq * nm.sm_scale, dk * nm.sm_scale, dv


def delta_of(dof: torch.Tensor, o_mode: torch.Tensor, nm: Numerics, o32: torch.Tensor | None = None,
             noise_keys: torch.Tensor | None = None, head_offset: int = 0,
             exact: torch.Tensor | None = None) -> torch.Tensor:
    """delta (batch, heads, seq) in FP32 from FP32 dO: delta_mode = rowsum(dO * O_mode) (``exact``, the exact pass,
    for fix=exact_delta), or on the amplified path (delta_gain != 1 or random signs) delta_ref + gain * s *
    (delta_mode - delta_ref) with delta_ref = rowsum(dO * o32) (delta_reference=fp32_output) or ``exact``
    (delta_reference=exact), s = +1 (kept) or +-1 per (noise key, global head, position) (random). Every operation
    is one FP32 rounding (s * gain is exact), as in the kernel's delta launch."""
    delta = exact if nm.fix == FIX_EXACT_DELTA else (dof * o_mode.float()).sum(-1)
    if not nm.amplified:
        return delta
    if nm.delta_exact_ref:
        delta_ref = exact
    elif o32 is None:
        raise ValueError("the amplified delta path needs the FP32 O of the forward (o32)")
    else:
        delta_ref = (dof * o32.float()).sum(-1)
    gain = torch.full_like(delta_ref, nm.delta_gain)
    if nm.delta_random:
        gain = gain * delta_signs(delta_ref.shape, noise_keys, head_offset, delta_ref.device)
    return delta_ref + gain * (delta - delta_ref)


def _prepare(q, k, v, settings: AttentionSettings, noise_keys=None):
    """Check arguments; FP32 inputs are rounded to bf16 (emulating BF16 autocast). Returns (q, k, v, Numerics)."""
    nm = check_args(q, k, v, settings, _REFERENCE_DTYPES, noise_keys)
    if q.dtype == torch.float32:
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    return q, k, v, nm


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if not (isinstance(b, int) and b >= 16 and b & (b - 1) == 0):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (the kernel's tile sizes)")


def _no_autocast(t: torch.Tensor):
    """The rounding points are explicit here; an enclosing autocast must not recast the FP32 products."""
    return torch.autocast(t.device.type, enabled=False)


class _ReferenceAttention(torch.autograd.Function):
    """Autograd wrapper: the forward saves LSE and the O that delta uses; the backward is the flash backward."""

    @staticmethod
    def forward(ctx, q, k, v, settings: AttentionSettings, noise_keys, block_n: int):
        in_dtype = q.dtype
        heads = q.shape[1]
        ql, kl, vl, nm = _prepare(q, k, v, settings, noise_keys)
        with _no_autocast(q):
            out, lse, o32 = forward_core(ql, _expand_kv(kl, heads), _expand_kv(vl, heads), settings.causal, nm,
                                         block_n, head_offset=settings.head_offset, total_heads=settings.total_heads,
                                         noise_keys=noise_keys)
        o_mode = o32 if nm.fix == FIX_FP32_OUTPUT else out  # what delta_mode uses (exact_delta: none)
        if nm.amplified:  # delta_fp32 from o32 (or the exact pass)
            ctx.save_for_backward(ql, kl, vl, o_mode, lse, o32, noise_keys)
        else:
            ctx.save_for_backward(ql, kl, vl, o_mode, lse, None, None)
        if nm.output_amplified:  # the next layer sees the amplified O; the backward's delta keeps the mode's
            out = amplified_output(out, o32, nm, noise_keys, settings.head_offset)
        ctx.args = (settings, nm, block_n, in_dtype)
        return out.to(in_dtype)

    @staticmethod
    def backward(ctx, d_out):
        ql, kl, vl, o_saved, lse, o32, noise_keys = ctx.saved_tensors
        settings, nm, block_n, in_dtype = ctx.args
        heads, kv_heads = ql.shape[1], kl.shape[1]
        with _no_autocast(ql):
            dq, dk, dv = backward_core(ql, _expand_kv(kl, heads), _expand_kv(vl, heads), o_saved, lse,
                                       d_out.contiguous(), settings.causal, nm, block_n, o32=o32,
                                       noise_keys=noise_keys, head_offset=settings.head_offset,
                                       out_fill=settings.out_fill)
        if kv_heads != heads:
            bsz, _, seq, dim = dk.shape
            dk = dk.view(bsz, kv_heads, heads // kv_heads, seq, dim).sum(2)
            dv = dv.view(bsz, kv_heads, heads // kv_heads, seq, dim).sum(2)
        return dq.to(in_dtype), dk.to(in_dtype), dv.to(in_dtype), None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
              noise_keys: torch.Tensor | None = None, block_n: int = KEY_TILE) -> torch.Tensor:
    """Flash attention in PyTorch with the kernel's tiling and rounding points, differentiable (the reference
    implementation behind ``kernels.attention``; ``reference_attention`` takes the settings' fields instead).

    q, k, v: (batch, heads, seq, head_dim) in bf16, fp16 or fp32; k/v may have fewer heads (grouped-query).
    FP32 inputs are first rounded to bf16 (what BF16 autocast feeds attention) and O comes back in FP32 (its values
    are bf16-representable); this is the path the model trains with on CPU. ``block_n`` (the key tile) must equal
    the kernel's for bit-level comparisons in rounding=fa2 (KEY_TILE, the kernel's fixed tile); rounding=paper
    rounds per paper tile whatever it is. ``settings.autotune`` and ``deterministic`` concern the compiled kernels
    and change nothing here; ``out_fill`` fills the backward's tile-filled gradient buffers (see ``backward_core``).
    """
    _check_blocks(KEY_TILE, block_n)
    return _ReferenceAttention.apply(q, k, v, settings, noise_keys, block_n)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *fields, block_m: int = 64,
                        block_n: int = KEY_TILE, noise_keys: torch.Tensor | None = None, **named) -> torch.Tensor:
    """``attention`` with ``AttentionSettings(*fields, **named)`` (positionally: causal, rounding, fix, beta, eps,
    ...), e.g. ``reference_attention(q, k, v, True, "paper", "dynamic_max")``. ``block_m`` is accepted for symmetry
    with the kernel and changes no bit (rows are independent)."""
    _check_blocks(block_m, block_n)
    return attention(q, k, v, AttentionSettings(*fields, **named), noise_keys, block_n)


def amplified_output(o_mode: torch.Tensor, o32: torch.Tensor, nm: Numerics, noise_keys: torch.Tensor | None = None,
                     head_offset: int = 0) -> torch.Tensor:
    """The output stress (output_gain != 1 or output_sign="random"): LP(O_fp32 + gain * s * (O_mode - O_fp32)) in
    the LP dtype, O_mode the mode's O (LP; SR'd for stochastic_output), O_fp32 the FP32 O (paper: its shadow),
    s = +1 or +-1 per (noise key, global head, position) with the output salt. Each operation rounds once in FP32
    (on the GPU the compiler may fuse the multiply-add: one rounding less, so the last LP bit can differ there)."""
    gain = torch.full(o32.shape[:-1], nm.output_gain, device=o32.device)
    if nm.output_random:
        gain = gain * delta_signs(o32.shape[:-1], noise_keys, head_offset, o32.device, OUTPUT_SIGN_SALT)
    return round_lp(o32 + gain.unsqueeze(-1) * (o_mode.float() - o32), o_mode.dtype).to(o_mode.dtype)


def effective_output(out: torch.Tensor, o32: torch.Tensor | None, nm: Numerics,
                     noise_keys: torch.Tensor | None = None, head_offset: int = 0,
                     o_exact: torch.Tensor | None = None) -> torch.Tensor:
    """The O whose rowsum(dO * O) is the backward's delta: the mode's O (LP, SR'd for stochastic_output, FP32 for
    fp32_output, ``o_exact`` = P V with the backward's P for exact_delta: ``exact_output``) or, on the amplified
    path, O_ref + gain * s * (O_mode - O_ref) in FP32 with O_ref = O_fp32 or ``o_exact`` (delta_reference=exact)
    (delta is linear in O, so its delta equals the backward's up to the FP32 rounding of the sums)."""
    o_mode = {FIX_FP32_OUTPUT: o32, FIX_EXACT_DELTA: o_exact}.get(nm.fix, out)
    if not nm.amplified:
        return o_mode
    o_ref = o_exact if nm.delta_exact_ref else o32
    gain = torch.full(o_ref.shape[:-1], nm.delta_gain, device=o_ref.device)
    if nm.delta_random:
        gain = gain * delta_signs(o_ref.shape[:-1], noise_keys, head_offset, o_ref.device)
    return o_ref + gain.unsqueeze(-1) * (o_mode.float() - o_ref)


def saved_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
                 noise_keys: torch.Tensor | None = None, block_n: int = KEY_TILE) -> torch.Tensor:
    """The O that the reference backward uses for delta (``effective_output``): LP O, the SR'd O for
    stochastic_output, the FP32 O for fix=fp32_output, P V for exact_delta, the FP32 effective O of the amplified
    delta path."""
    heads = q.shape[1]
    ql, kl, vl, nm = _prepare(q, k, v, settings, noise_keys)
    kl, vl = _expand_kv(kl, heads), _expand_kv(vl, heads)
    with _no_autocast(q):
        out, lse, o32 = forward_core(ql, kl, vl, settings.causal, nm, block_n, head_offset=settings.head_offset,
                                     total_heads=settings.total_heads, noise_keys=noise_keys)
        o_exact = exact_output(ql, kl, vl, lse, settings.causal, nm, block_n) if nm.exact_pass else None
        return effective_output(out, o32, nm, noise_keys, settings.head_offset, o_exact)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in FP64 of the given (low-precision) inputs: (O, P), (B, H, T, hd) and (B, H, T, T).

    The one ground truth that tests, the tie-bias measurement and the delta-bias monitors compare against; k/v heads are
    repeated for grouped-query attention; differentiable (tests take fp64 gradients through it)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        t = q.shape[-2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return p @ v, p
