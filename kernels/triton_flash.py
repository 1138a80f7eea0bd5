"""Triton flash attention (FA2-style forward and backward) with explicit, selectable rounding points.

Same numerics as ``kernels.reference`` (see its docstring for the rounding points of each mode). Where the GPU's
own casts are already round-to-nearest-even they are used; under the Triton interpreter (``TRITON_INTERPRET=1``,
read when this module is first imported) every rounding is done on the FP32 bit pattern instead, because the
interpreter's fp32 -> bf16 cast truncates, and every matrix product runs on FP32 operands holding LP values,
because the interpreter's bf16 ``tl.dot`` is wrong. Both choices are compile-time flags (EXPLICIT).

In rounding=fa2 the row maximum is taken on the raw FP32 q.k and P_bar = exp2((q.k - m) * scale*log2(e)): subtracting
before scaling keeps the largest term exactly 1 at any logit (a fused q.k*scale - m, as FA2 kernels do it, leaves the
product's rounding error in the exponent: harmless for ordinary logits, inf or 0 beyond ~1e9). It costs one multiply
per score.

In rounding=paper the forward walks paper tiles of PAPER_TILE keys (512 by default, 0 = the whole row), each in two
passes over its BLOCK_N-key blocks: the tile's max (and the fixes' tie test), taken on the raw q.k and rounded once
(rounding keeps the order), then P_bar with that max, the FP32 row sum and the FP32-accumulated P_bar V; the running
O and l are rounded once per tile (``_fwd_paper_tiles``). With bf16 and a power-of-two scale the scores' second
rounding is a no-op and left out (``_paper_score``).

Layout: q, k, v are (batch, heads, seq, head_dim) with any strides but a unit last one, k/v may have fewer heads
(grouped-query attention). O, the FP32 O and dq/dk/dv are allocated like their inputs (``_like``), dO is read with
its own strides. The forward saves LSE (FP32, natural log) and, for fix=fp32_output, an FP32 copy of the normalised
O. The backward is three launches: delta = rowsum(dO * O_saved); dK, dV per key tile (looping over the query heads of
its group, so no atomics); dQ per query tile. With ``deterministic=False`` the dK/dV launch also adds each key tile's
share of dQ into an FP32 buffer with atomics, and the third launch only scales and rounds it. Launches go through
``_Kernel``, which caches the compiled binaries.

This is the "triton" implementation behind ``kernels.attention``: ``prepare``, ``forward``, ``backward``,
``forward_outputs`` and ``backward_outputs`` take one ``AttentionSettings`` record; kernels/ops.py makes them an
autograd function and the torch.compile custom ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the dQ kernel keeps its pointer loads
    TensorDescriptor = None

from kernels.modes import FIX_EXACT_DELTA, AttentionSettings, Numerics, check_args

INTERPRET = bool(triton.knobs.runtime.interpret)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _new(shape, dtype, device, fill: float | None = None) -> torch.Tensor:
    """An output buffer: uninitialised, or filled with ``fill`` (``out_fill`` of the public functions)."""
    if fill is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, fill, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Rounding helpers (device side)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _rne_bf16_bits(x):
    """FP32 -> nearest bf16 value (ties to even) on the bit pattern; returns FP32. NaN stays NaN."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _round_lp(x, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """Round FP32 x to the LP dtype (RNE), keeping FP32. Explicit bit rounding only where the cast would truncate."""
    if IS_BF16:
        if EXPLICIT:
            y = _rne_bf16_bits(x)
        else:
            y = x.to(tl.bfloat16).to(tl.float32)
    else:
        y = x.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _lp_operand(x, LP: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """FP32 x as an MMA operand in LP: the LP tensor on a GPU, FP32 holding the RNE-rounded values when interpreting."""
    if EXPLICIT:
        y = _round_lp(x, IS_BF16, EXPLICIT)
    else:
        y = x.to(LP)
    return y


@triton.jit
def _loaded_operand(x, EXPLICIT: tl.constexpr):
    """A loaded LP tensor as an MMA operand (upcast to FP32 when interpreting: exact)."""
    if EXPLICIT:
        y = x.to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def _mma(a, b, acc, EXPLICIT: tl.constexpr):
    """a @ b (+ acc) with FP32 accumulation; when interpreting, operands are FP32 and the product is exact IEEE."""
    if EXPLICIT:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _safe_shift(r_m, rows, bh):
    """Shift of the safe dynamic_max fix: delta in [2^-6, 2^-6 + 0.5), hashed from (bh, row, bf16 bits of r_m).

    ``bh`` is the global (batch, head) index b * total_heads + head_offset + h, not the launch's program index.

    uint32 arithmetic wraps modulo 2^32, matching ``kernels.rounding.safe_shift`` (int64 masked to 32 bits).
    """
    rm = tl.where(r_m == 0.0, 0.0, r_m)
    rbits = _rne_bf16_bits(rm).to(tl.uint32, bitcast=True) >> 16
    key = rbits ^ (rows.to(tl.uint32) * 0x9E3779B1) ^ (bh.to(tl.uint32) * 0x85EBCA77)
    key = ((key >> 16) ^ key) * 0x045D9F3B
    key = ((key >> 16) ^ key) * 0x045D9F3B
    key = (key >> 16) ^ key
    u = (key & 0xFFFF).to(tl.float32)
    return u * 7.62939453125e-06 + 0.015625


@triton.jit
def _mix32(x):
    """``kernels.rounding.mix32`` on uint32 (wraps modulo 2^32 like the reference's masked int64)."""
    x = ((x >> 16) ^ x) * 0x045D9F3B
    x = ((x >> 16) ^ x) * 0x045D9F3B
    return (x >> 16) ^ x


@triton.jit
def _row_hash(key, head, rows):
    """``kernels.rounding.noise_row_hash``: hash of (row key (uint32), global head, query positions)."""
    x = _mix32(key + (head + 1).to(tl.uint32) * 0x85EBCA77)
    return _mix32(x + (rows + 1).to(tl.uint32) * 0xC2B2AE3D)


@triton.jit
def _sr_bf16(x, row_hash, channels):
    """fix=stochastic_output: x (FP32, rows x channels) rounded stochastically to bf16 (``kernels.rounding.sr_bf16``
    with ``sr_bits``): 16 hash bits per element added to the FP32 bit pattern, the low 16 bits cleared. Returns FP32
    holding bf16 values (exact in any later cast); NaN stays NaN."""
    u = _mix32(row_hash[:, None] + (channels[None, :] + 1).to(tl.uint32) * 0x27D4EB2F) & 0xFFFF
    b = (x.to(tl.uint32, bitcast=True) + u) & 0xFFFF0000
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _fix_max(r_m, tied, rows, bh, beta, shift_scale, PAPER: tl.constexpr, FIX: tl.constexpr, IS_BF16: tl.constexpr,
             EXPLICIT: tl.constexpr):
    """Maximum that a score tile contributes to the online softmax, per row, given its row max r_m and whether it
    is attained more than once (within eps; see reference._tile_max)."""
    if FIX == 1:  # dynamic_max (safe): bounded, per-row varying shift of a repeated maximum
        m = tl.where(tied, r_m + _safe_shift(r_m, rows, bh) * shift_scale, r_m)
    elif FIX == 2:  # dynamic_max_published
        scaled = r_m * beta
        if PAPER:
            scaled = _round_lp(scaled, IS_BF16, EXPLICIT)
        m = tl.where(tied & (r_m > 0), scaled, r_m)
        m = tl.where(tied & (r_m < 0), 0.0, m)
    else:
        m = r_m
    return m


@triton.jit
def _clamped_row_sum(row_sum, r_m, FIX: tl.constexpr):
    """The published rule clamps a tile's row sum at 1e-10 like the authors' code (a row whose every P_bar
    underflows ends with O = 0, not 0/0); rows without a valid key in the tile (r_m = -inf) keep 0 (a no-op)."""
    if FIX == 2:
        row_sum = tl.where(r_m > float("-inf"), tl.maximum(row_sum, 1e-10), row_sum)
    return row_sum


# ----------------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _top2(a1, a2, b1, b2):
    """Combine of a (largest, second largest) reduction, counting a repeated value twice."""
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))


@triton.jit
def _row_top2(s, EXPLICIT: tl.constexpr):
    """Per row of s: (largest, second largest) value, a repeated largest value counted twice. On the GPU one
    two-value reduction (cheaper than a row max plus a compare and an integer count per score); the interpreter runs
    a reduction's combine function in Python, which made fa2's dynamic fixes ~15x slower to interpret than the rest
    of the kernel, so there the same two values come from a vectorised max, compare and count (the GPU's reduction
    is checked against the reference in tests/gpu)."""
    if EXPLICIT:
        top1 = tl.max(s, 1)
        at_max = s == top1[:, None]
        repeated = tl.sum(at_max.to(tl.int32), 1) > 1
        top2 = tl.where(repeated, top1, tl.max(tl.where(at_max, float("-inf"), s), 1))
    else:
        top1, top2 = tl.reduce((s, tl.full(s.shape, float("-inf"), tl.float32)), 1, _top2)
    return top1, top2


@triton.jit
def _block_qk(q, k_base, stride_kt, offs_m, offs_d, T, start_n, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, EXPLICIT: tl.constexpr):
    """The raw FP32 q.k of the key block at start_n, -inf where MASKED excludes an entry (keys past T; with CAUSAL,
    keys after the query)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k_ptrs = k_base + cols[:, None] * stride_kt + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=cols[:, None] < T, other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = _mma(q, tl.trans(_loaded_operand(k, EXPLICIT)), None, EXPLICIT)
    if MASKED:
        valid = cols[None, :] < T
        if CAUSAL:
            valid = valid & (offs_m[:, None] >= cols[None, :])
        qk = tl.where(valid, qk, float("-inf"))
    return qk


@triton.jit
def _fwd_tiles(acc, l_i, m_i, seen_max, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, bh_hash, T, lo, hi,
               exp_scale, shift_scale, beta, eps_cmp, LP: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, FIX: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """rounding=fa2: online softmax over key tiles [lo, hi); MASKED adds the causal and ragged-tail masks.

    ``bh_hash``: the global (batch, head) index that the safe fix hashes (never used to address memory);
    ``seen_max``: the raw row maximum of the tiles before (kept only for fa2's safe fix)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
        s = _block_qk(q, k_base, stride_kt, offs_m, offs_d, T, start_n, BLOCK_N, MASKED, CAUSAL, EXPLICIT)
        if FIX == 1 or FIX == 2:
            # "r_m attained more than once within eps" is r_m - (second largest score, with multiplicity) <= eps
            r_m, second = _row_top2(s, EXPLICIT)
            tied = (r_m - second) <= eps_cmp
            if FIX == 1:  # safe fix: a maximum repeated in an earlier tile meets the same midpoint at the final cast
                tied = tied | (tl.abs(r_m - seen_max) <= eps_cmp)
                seen_max = tl.maximum(seen_max, r_m)
            m_new = tl.maximum(m_i, _fix_max(r_m, tied, offs_m, bh_hash, beta, shift_scale, False, FIX, IS_BF16,
                                             EXPLICIT))
        else:
            r_m = tl.max(s, 1)
            m_new = tl.maximum(m_i, r_m)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = _loaded_operand(v, EXPLICIT)
        p = tl.exp2((s - m_use[:, None]) * exp_scale)  # subtract first: the maximum's term is exactly 1
        alpha = tl.exp2((m_i - m_use) * exp_scale)
        l_i = l_i * alpha + _clamped_row_sum(tl.sum(p, 1), r_m, FIX)
        acc = _mma(_lp_operand(p, LP, IS_BF16, EXPLICIT), v, acc * alpha[:, None], EXPLICIT)
        m_i = m_new
    return acc, l_i, m_i, seen_max


@triton.jit
def _paper_score(qk, scale, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """S = LP(LP(q.k) * scale): the authors' autocast rounds the product, then the scaled scores. SCALE_POW2 (bf16
    and a power-of-two scale: head_dim 16 or 64 of the supported ones): a bf16 value times 2^-k is a bf16 value while it stays at or
    above FP32's smallest normal, 2^-126, so the second rounding changes nothing and is left out (one conversion
    less per score; ``Numerics.score_rounds_once`` says when, test_pow2_scale_keeps_bf16_scores_exact checks it)."""
    s = _round_lp(qk, IS_BF16, EXPLICIT) * scale
    if not SCALE_POW2:
        s = _round_lp(s, IS_BF16, EXPLICIT)
    return s


@triton.jit
def _paper_tile_max(top1, top2, q, k_base, stride_kt, offs_m, offs_d, T, lo, hi, BLOCK_N: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, TIES: tl.constexpr, EXPLICIT: tl.constexpr):
    """Pass 1 over the key blocks [lo, hi) of a paper tile: the largest raw product q.k per row, top1, and (TIES)
    the second largest, top2, counted with multiplicity; masked entries -inf. The caller rounds them as the scores
    are rounded: S = LP(LP(q.k) * scale) is a non-decreasing function of q.k (scale > 0), so it keeps the order of
    the scores and the two largest rounded scores are the rounded two largest products, bit for bit, at a fraction
    of the cost of rounding every score (at head_dim 64 this pass is bound by element-wise work, not the MMA).
    "r_m attained more than once within eps" is then r_m - top2 <= eps: the same rows as the reference's tie
    count, without a second pass that needs r_m first."""
    for start_n in range(lo, hi, BLOCK_N):
        qk = _block_qk(q, k_base, stride_kt, offs_m, offs_d, T, start_n, BLOCK_N, MASKED, CAUSAL, EXPLICIT)
        if TIES:
            block_max, block_second = _row_top2(qk, EXPLICIT)
            top2 = tl.maximum(tl.maximum(top2, block_second), tl.minimum(top1, block_max))
        else:
            block_max = tl.max(qk, 1)
        top1 = tl.maximum(top1, block_max)
    return top1, top2


@triton.jit
def _paper_tile_sums(pv, row_sum, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, lo, hi, m_use,
                     score_scale, exp_scale, LP: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                     CAUSAL: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr,
                     EXPLICIT: tl.constexpr):
    """Pass 2 over the key blocks [lo, hi) of a paper tile: P_bar = exp(LP(S - m)) with the tile's m; the FP32
    row sum and the FP32-accumulated product LP(P_bar) V (rounded once, at the tile's end, by the caller)."""
    for start_n in range(lo, hi, BLOCK_N):
        qk = _block_qk(q, k_base, stride_kt, offs_m, offs_d, T, start_n, BLOCK_N, MASKED, CAUSAL, EXPLICIT)
        s = _paper_score(qk, score_scale, SCALE_POW2, IS_BF16, EXPLICIT)  # the roundings keep -inf
        p = tl.exp2(_round_lp(s - m_use[:, None], IS_BF16, EXPLICIT) * exp_scale)
        row_sum += tl.sum(p, 1)
        cols = start_n + tl.arange(0, BLOCK_N)
        v_ptrs = v_base + cols[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            v = tl.load(v_ptrs, mask=cols[:, None] < T, other=0.0)
        else:
            v = tl.load(v_ptrs)
        pv = _mma(_lp_operand(p, LP, IS_BF16, EXPLICIT), _loaded_operand(v, EXPLICIT), pv, EXPLICIT)
    return pv, row_sum


@triton.jit
def _fwd_paper_tiles(acc, l_i, m_i, acc32, l32, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, bh_hash, T,
                     full_hi, hi, score_scale, exp_scale, shift_scale, beta, eps_cmp, LP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAPER_TILE: tl.constexpr,
                     CAUSAL: tl.constexpr, FIX: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr,
                     EXPLICIT: tl.constexpr, SHADOW: tl.constexpr):
    """rounding=paper: the online softmax over tiles of PAPER_TILE keys (0: the whole row [0, hi)), rounding the
    running O and l once per tile. Each tile takes two passes over its BLOCK_N-key blocks: the tile's max (and tie
    test), then P_bar with that max. Blocks below full_hi need no mask. A tile without a valid key for a row (above
    the causal diagonal) leaves that row exactly as it was: alpha = 1, P_bar = 0, no clamp."""
    TIES: tl.constexpr = FIX == 1 or FIX == 2
    if PAPER_TILE == 0:
        tile_keys = hi
    else:
        tile_keys = PAPER_TILE
    for t0 in range(0, hi, tile_keys):
        t1 = tl.minimum(t0 + tile_keys, hi)
        split = tl.minimum(tl.maximum(full_hi, t0), t1)  # [t0, split) unmasked, [split, t1) masked
        top1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        top2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
        top1, top2 = _paper_tile_max(top1, top2, q, k_base, stride_kt, offs_m, offs_d, T, t0, split, BLOCK_N,
                                     False, CAUSAL, TIES, EXPLICIT)
        top1, top2 = _paper_tile_max(top1, top2, q, k_base, stride_kt, offs_m, offs_d, T, split, t1, BLOCK_N,
                                     True, CAUSAL, TIES, EXPLICIT)
        top1 = _paper_score(top1, score_scale, SCALE_POW2, IS_BF16, EXPLICIT)
        top2 = _paper_score(top2, score_scale, SCALE_POW2, IS_BF16, EXPLICIT)
        tied = (top1 - top2) <= eps_cmp
        m_new = tl.maximum(m_i, _fix_max(top1, tied, offs_m, bh_hash, beta, shift_scale, True, FIX, IS_BF16,
                                         EXPLICIT))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        pv = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
        pv, row_sum = _paper_tile_sums(pv, row_sum, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, t0,
                                       split, m_use, score_scale, exp_scale, LP, BLOCK_N, False, CAUSAL,
                                       SCALE_POW2, IS_BF16, EXPLICIT)
        pv, row_sum = _paper_tile_sums(pv, row_sum, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d, T, split,
                                       t1, m_use, score_scale, exp_scale, LP, BLOCK_N, True, CAUSAL,
                                       SCALE_POW2, IS_BF16, EXPLICIT)
        row_sum = _clamped_row_sum(row_sum, top1, FIX)
        alpha = tl.exp2(_round_lp(m_i - m_use, IS_BF16, EXPLICIT) * exp_scale)
        l_i = _round_lp(alpha * l_i + row_sum, IS_BF16, EXPLICIT)
        acc = _round_lp(_round_lp(acc * alpha[:, None], IS_BF16, EXPLICIT) + _round_lp(pv, IS_BF16, EXPLICIT),
                        IS_BF16, EXPLICIT)
        if SHADOW:
            acc32 = acc32 * alpha[:, None] + pv
            l32 = l32 * alpha + row_sum
        m_i = m_new
    return acc, l_i, m_i, acc32, l32


@triton.jit
def _fwd_kernel(Q, K, V, O, O32, OMODE, LSE, KEYS, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot, H, GROUP, T, head_offset,
                total_heads, score_scale, exp_scale, shift_scale, beta, eps_cmp, out_gain, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr,
                PAPER_TILE: tl.constexpr, FIX: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr,
                EXPLICIT: tl.constexpr, STORE_O32: tl.constexpr, OUT_AMP: tl.constexpr, OUT_RANDOM: tl.constexpr):
    """OUT_AMP (the output stress): O = LP(O32 + out_gain * s * (O_mode - O32)), s = +-1 per row from the noise
    hash with the output salt when OUT_RANDOM, and the mode's own O goes to OMODE (the backward's delta uses it)."""
    LP: tl.constexpr = O.dtype.element_ty
    # paper keeps an FP32 shadow accumulation where an FP32 O is stored (fp32_output, the amplified delta path),
    # stochastically rounded (stochastic_output) or the output stress's reference; fa2's FP32 O is its accumulator
    SHADOW: tl.constexpr = PAPER and (STORE_O32 or FIX == 4 or OUT_AMP)
    start_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest causal tiles first
    bh = tl.program_id(1)  # local (batch, head) index: addresses this call's tensors
    b = bh // H
    h = bh % H
    # Global (batch, head) index of the model (head_offset, total_heads: runtime ints, so a tensor-parallel rank's
    # slice of the heads hashes like the same heads of an unsharded call); only the safe fix's hash uses it.
    bh_hash = b * total_heads + head_offset + h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = _loaded_operand(q, EXPLICIT)
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    v_base = V + b * stride_vb + (h // GROUP) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    seen_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if SHADOW:
        acc32 = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        l32 = tl.zeros([BLOCK_M], tl.float32)
    else:
        acc32 = tl.zeros([1, 1], tl.float32)
        l32 = tl.zeros([1], tl.float32)
    if CAUSAL:
        full_hi = start_m * BLOCK_M  # key tiles left of the diagonal block: every entry valid
        hi = tl.minimum((start_m + 1) * BLOCK_M, T)
    else:
        full_hi = (T // BLOCK_N) * BLOCK_N
        hi = T
    if PAPER:
        acc, l_i, m_i, acc32, l32 = _fwd_paper_tiles(acc, l_i, m_i, acc32, l32, q, k_base, v_base, stride_kt,
                                                     stride_vt, offs_m, offs_d, bh_hash, T, full_hi, hi, score_scale,
                                                     exp_scale, shift_scale, beta, eps_cmp, LP, HEAD_DIM, BLOCK_M,
                                                     BLOCK_N, PAPER_TILE, CAUSAL, FIX, SCALE_POW2, IS_BF16, EXPLICIT,
                                                     SHADOW)
    else:
        acc, l_i, m_i, seen_max = _fwd_tiles(acc, l_i, m_i, seen_max, q, k_base, v_base, stride_kt, stride_vt, offs_m,
                                             offs_d, bh_hash, T, 0, full_hi, exp_scale, shift_scale, beta, eps_cmp,
                                             LP, BLOCK_N, False, CAUSAL, FIX, IS_BF16, EXPLICIT)
        acc, l_i, m_i, seen_max = _fwd_tiles(acc, l_i, m_i, seen_max, q, k_base, v_base, stride_kt, stride_vt, offs_m,
                                             offs_d, bh_hash, T, full_hi, hi, exp_scale, shift_scale, beta, eps_cmp,
                                             LP, BLOCK_N, True, CAUSAL, FIX, IS_BF16, EXPLICIT)
    l_div = tl.where(l_i == 0.0, 1.0, l_i)  # fully masked rows only: O = 0
    if EXPLICIT:
        o_div = acc / l_div[:, None]
    else:
        o_div = tl.math.div_rn(acc, l_div[:, None])
    if SHADOW:
        l32 = tl.where(l32 == 0.0, 1.0, l32)
        if EXPLICIT:
            o32 = acc32 / l32[:, None]
        else:
            o32 = tl.math.div_rn(acc32, l32[:, None])
    else:
        o32 = o_div
    o_off = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]  # O32 shares O's layout
    if OUT_AMP:
        if FIX == 4:
            key = tl.load(KEYS + b).to(tl.uint32)
            o_mode = _sr_bf16(o32, _row_hash(key, head_offset + h, offs_m), offs_d)
        else:
            o_mode = _round_lp(o_div, IS_BF16, EXPLICIT)
        gs = tl.full([BLOCK_M], out_gain, tl.float32)
        if OUT_RANDOM:
            key = tl.load(KEYS + b).to(tl.uint32)
            negative = (_mix32(_row_hash(key, head_offset + h, offs_m) ^ 0x2C1B3C6D) >> 31) == 1
            gs = tl.where(negative, -gs, gs)
        o_out = _round_lp(o32 + gs[:, None] * (o_mode - o32), IS_BF16, EXPLICIT)
        tl.store(OMODE + o_off, o_mode.to(LP), mask=row_ok[:, None])  # OMODE shares O's layout
        tl.store(O + o_off, o_out.to(LP), mask=row_ok[:, None])
    elif FIX == 4:  # stochastic_output: SR of the FP32 O, keyed by (row key, global head, position, channel)
        key = tl.load(KEYS + b).to(tl.uint32)
        o_sr = _sr_bf16(o32, _row_hash(key, head_offset + h, offs_m), offs_d)
        tl.store(O + o_off, o_sr.to(LP), mask=row_ok[:, None])
    elif EXPLICIT:
        tl.store(O + o_off, _round_lp(o_div, IS_BF16, EXPLICIT).to(LP), mask=row_ok[:, None])
    else:
        tl.store(O + o_off, o_div.to(LP), mask=row_ok[:, None])
    if PAPER:
        lse = m_i + tl.log2(l_i) * 0.6931471805599453
    else:
        lse = (m_i * exp_scale + tl.log2(l_i)) * 0.6931471805599453
    tl.store(LSE + bh * T + offs_m, lse, mask=row_ok)
    if STORE_O32:
        tl.store(O32 + o_off, o32, mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _row_tile(X, b, h, stride_b, stride_h, stride_t, offs_m, offs_d, ok):
    """Rows offs_m of x[b, h] as an FP32 (rows x head_dim) tile, zeros where ``ok`` (the rows < T) is false: the loads
    of both delta launches and of the dQ finish. The caller computes ``ok`` once, as the kernels did before this
    helper, so their sm_90 PTX is unchanged instruction for instruction."""
    return tl.load(X + b * stride_b + h * stride_h + offs_m[:, None] * stride_t + offs_d[None, :], mask=ok,
                   other=0.0).to(tl.float32)


@triton.jit
def _bwd_delta_kernel(OS, DO, DELTA, stride_ob, stride_oh, stride_ot, stride_dob, stride_doh, stride_dot, H, T,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O_saved) in FP32; O_saved is the LP O or the FP32 O (fix=fp32_output)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m[:, None] < T
    o = _row_tile(OS, b, h, stride_ob, stride_oh, stride_ot, offs_m, offs_d, ok)
    do = _row_tile(DO, b, h, stride_dob, stride_doh, stride_dot, offs_m, offs_d, ok)
    tl.store(DELTA + bh * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


@triton.jit
def _bwd_delta_gain_kernel(OS, O32, DO, KEYS, EXACT, DELTA, stride_ob, stride_oh, stride_ot, stride_32b, stride_32h,
                           stride_32t, stride_dob, stride_doh, stride_dot, H, T, head_offset, gain,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, RANDOM: tl.constexpr,
                           MODE_EXACT: tl.constexpr, REF_EXACT: tl.constexpr):
    """The amplified delta (delta_gain != 1 or random signs): delta_ref + gain * s * (delta_mode - delta_ref) with
    delta_mode = rowsum(dO * O_saved) (MODE_EXACT, fix=exact_delta: the exact pass's EXACT), delta_ref =
    rowsum(dO * O32) (REF_EXACT, delta_reference=exact: EXACT); s = +-1 from the noise hash of (row key, global
    head head_offset + h, position) when RANDOM, else +1. Launched without FMA contraction, so every operation
    rounds once as in the reference."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m[:, None] < T
    do = _row_tile(DO, b, h, stride_dob, stride_doh, stride_dot, offs_m, offs_d, ok)
    if MODE_EXACT or REF_EXACT:
        exact = tl.load(EXACT + bh * T + offs_m, mask=offs_m < T, other=0.0)
    if MODE_EXACT:
        d_mode = exact
    else:
        o = _row_tile(OS, b, h, stride_ob, stride_oh, stride_ot, offs_m, offs_d, ok)
        d_mode = tl.sum(o * do, 1)
    if REF_EXACT:
        d32 = exact
    else:
        o32 = _row_tile(O32, b, h, stride_32b, stride_32h, stride_32t, offs_m, offs_d, ok)  # FP32 already
        d32 = tl.sum(o32 * do, 1)
    gs = tl.full([BLOCK_M], gain, tl.float32)
    if RANDOM:
        key = tl.load(KEYS + b).to(tl.uint32)
        negative = (_mix32(_row_hash(key, head_offset + h, offs_m) ^ 0x68E31DA4) >> 31) == 1
        gs = tl.where(negative, -gs, gs)
    tl.store(DELTA + bh * T + offs_m, d32 + gs * (d_mode - d32), mask=offs_m < T)


@triton.jit
def _probs_t(k, qt, lse, sm_scale, exp_scale, PAPER: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr,
             EXPLICIT: tl.constexpr):
    """P^T of a (key tile x query tile) block recomputed from LSE (natural log), scores rounded as in the forward."""
    s_t = _mma(k, qt, None, EXPLICIT)
    if PAPER:
        s_t = _paper_score(s_t, sm_scale, SCALE_POW2, IS_BF16, EXPLICIT)
    return tl.exp2(s_t * exp_scale - (lse * 1.4426950408889634)[None, :])  # one FMA per score


@triton.jit
def _bwd_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, cols, offs_d, T, lo,
                    hi, DQ32, dq32_base, stride_dq32t, b, h,
                    sm_scale, exp_scale, LP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr, SCALE_POW2: tl.constexpr,
                    IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr):
    """Accumulate dK^T-side products of one key tile over query tiles [lo, hi) of one head (query head h).
    ATOMIC_DQ: also add this key tile's share of dQ, LP(dS) K (unscaled), into the FP32 buffer of query rows
    (``dq32_base`` + row * stride_dq32t, or through the 4-D descriptor DQ32 when DQ_TMA: a TMA reduction)."""
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q_ptrs = q_base + rows[:, None] * stride_qt + offs_d[None, :]
        do_ptrs = do_base + rows[:, None] * stride_dot + offs_d[None, :]
        if MASKED:
            q = tl.load(q_ptrs, mask=rows[:, None] < T, other=0.0)
            do = tl.load(do_ptrs, mask=rows[:, None] < T, other=0.0)
            lse = tl.load(lse_base + rows, mask=rows < T, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < T, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        q = _loaded_operand(q, EXPLICIT)
        do = _loaded_operand(do, EXPLICIT)
        pt = _probs_t(k, tl.trans(q), lse, sm_scale, exp_scale, PAPER, SCALE_POW2, IS_BF16, EXPLICIT)
        if MASKED:
            valid = (rows[None, :] < T) & (cols[:, None] < T)
            if CAUSAL:
                valid = valid & (rows[None, :] >= cols[:, None])
            pt = tl.where(valid, pt, 0.0)
        dv = _mma(_lp_operand(pt, LP, IS_BF16, EXPLICIT), do, dv, EXPLICIT)
        dpt = _mma(v, tl.trans(do), None, EXPLICIT)
        dst = _lp_operand(pt * (dpt - delta[None, :]), LP, IS_BF16, EXPLICIT)
        dk = _mma(dst, q, dk, EXPLICIT)
        if ATOMIC_DQ:
            dq_share = _mma(tl.trans(dst), k, None, EXPLICIT)
            if DQ_TMA:  # rows past T lie outside the descriptor: the TMA unit drops them
                DQ32.atomic_add([b, h, start_m, 0], dq_share.reshape(1, 1, BLOCK_M, HEAD_DIM))
            else:
                dq_ptrs = dq32_base + rows[:, None] * stride_dq32t + offs_d[None, :]
                if MASKED:
                    tl.atomic_add(dq_ptrs, dq_share, mask=rows[:, None] < T, sem="relaxed")
                else:
                    tl.atomic_add(dq_ptrs, dq_share, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ32, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
                     stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_dkb,
                     stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt, H, GROUP, T, exp_scale, sm_scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                     PAPER: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr,
                     ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr):
    """dK and dV of one key tile of one k/v head, summed over the GROUP query heads that share it. ATOMIC_DQ (the
    non-deterministic backward): dQ's shares are added into DQ32, a contiguous FP32 (B, H, T, head_dim) buffer of
    zeros (a 4-D TMA descriptor of it when DQ_TMA), in whatever order the tiles finish; ``_bwd_dq_finish_kernel``
    scales and rounds it."""
    LP: tl.constexpr = DK.dtype.element_ty
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    h_kv = H // GROUP
    b = bhk // h_kv
    hk = bhk % h_kv
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols[:, None] < T
    k = tl.load(K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kt + offs_d[None, :], mask=col_ok,
                other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok,
                other=0.0)
    k = _loaded_operand(k, EXPLICIT)
    v = _loaded_operand(v, EXPLICIT)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:
        m_lo = (start_n // BLOCK_M) * BLOCK_M
        m_diag = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M  # query tiles that cross the diagonal
    else:
        m_lo = 0
        m_diag = 0
    full_end = (T // BLOCK_M) * BLOCK_M
    m_end = tl.cdiv(T, BLOCK_M) * BLOCK_M
    m_diag = tl.minimum(m_diag, m_end)
    tail_lo = tl.maximum(m_diag, full_end)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + bh * T
        delta_base = DELTA + bh * T
        if DQ_TMA:
            dq32_base = DQ32  # unused: the descriptor addresses the rows
        else:
            dq32_base = DQ32 + bh * T * HEAD_DIM  # contiguous (B, H, T, head_dim); unused unless ATOMIC_DQ
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, cols,
                                 offs_d, T, m_lo, m_diag, DQ32, dq32_base, HEAD_DIM, b, h, sm_scale, exp_scale, LP,
                                 HEAD_DIM, BLOCK_M, True, CAUSAL, PAPER, SCALE_POW2, IS_BF16, EXPLICIT, ATOMIC_DQ,
                                 DQ_TMA)
        if start_n + BLOCK_N <= T:
            dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                     cols, offs_d, T, m_diag, full_end, DQ32, dq32_base, HEAD_DIM, b, h, sm_scale,
                                     exp_scale, LP, HEAD_DIM, BLOCK_M, False, CAUSAL, PAPER, SCALE_POW2, IS_BF16,
                                     EXPLICIT, ATOMIC_DQ, DQ_TMA)
        else:
            dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot,
                                     cols, offs_d, T, m_diag, full_end, DQ32, dq32_base, HEAD_DIM, b, h, sm_scale,
                                     exp_scale, LP, HEAD_DIM, BLOCK_M, True, CAUSAL, PAPER, SCALE_POW2, IS_BF16,
                                     EXPLICIT, ATOMIC_DQ, DQ_TMA)
        dk, dv = _bwd_dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dot, cols,
                                 offs_d, T, tail_lo, m_end, DQ32, dq32_base, HEAD_DIM, b, h, sm_scale, exp_scale, LP,
                                 HEAD_DIM, BLOCK_M, True, CAUSAL, PAPER, SCALE_POW2, IS_BF16, EXPLICIT, ATOMIC_DQ,
                                 DQ_TMA)
    dk = dk * sm_scale
    if EXPLICIT:
        dk = _round_lp(dk, IS_BF16, EXPLICIT)
        dv = _round_lp(dv, IS_BF16, EXPLICIT)
    tl.store(DK + b * stride_dkb + hk * stride_dkh + cols[:, None] * stride_dkt + offs_d[None, :], dk.to(LP),
             mask=col_ok)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + cols[:, None] * stride_dvt + offs_d[None, :], dv.to(LP),
             mask=col_ok)


@triton.jit
def _key_rows(X, b, hk, start_n, x_base, stride_t, cols, offs_d, T, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, TMA: tl.constexpr):
    """Rows [start_n, start_n + BLOCK_N) of k or v (BLOCK_N x head_dim, LP), zeros past T: a TMA load through the
    4-D tensor descriptor X (it zero-fills out-of-bounds rows), else a pointer load from x_base (this head's rows)."""
    if TMA:
        x = X.load([b, hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        ptrs = x_base + cols[:, None] * stride_t + offs_d[None, :]
        if MASKED:
            x = tl.load(ptrs, mask=cols[:, None] < T, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _block_p_dp(q, do, lse2, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T, start_n, sm_scale,
                exp_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, PAPER: tl.constexpr, SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr,
                EXPLICIT: tl.constexpr, TMA: tl.constexpr):
    """(P, dP = dO V^T, the k tile) of one query tile against the key block at start_n: P recomputed from LSE
    (``lse2`` = LSE * log2(e)) as the forward scored it, 0 where masked; the dQ loop and the exact-delta pass."""
    cols = start_n + tl.arange(0, BLOCK_N)
    k = _key_rows(K, b, hk, start_n, k_base, stride_kt, cols, offs_d, T, BLOCK_N, HEAD_DIM, MASKED, TMA)
    v = _key_rows(V, b, hk, start_n, v_base, stride_vt, cols, offs_d, T, BLOCK_N, HEAD_DIM, MASKED, TMA)
    k = _loaded_operand(k, EXPLICIT)
    v = _loaded_operand(v, EXPLICIT)
    s = _mma(q, tl.trans(k), None, EXPLICIT)
    if PAPER:
        s = _paper_score(s, sm_scale, SCALE_POW2, IS_BF16, EXPLICIT)
    p = tl.exp2(s * exp_scale - lse2[:, None])
    if MASKED:
        valid = (rows[:, None] < T) & (cols[None, :] < T)
        if CAUSAL:
            valid = valid & (rows[:, None] >= cols[None, :])
        p = tl.where(valid, p, 0.0)
    dp = _mma(do, tl.trans(v), None, EXPLICIT)
    return p, dp, k


@triton.jit
def _bwd_dq_tiles(dq, q, do, lse, delta, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T, lo, hi,
                  sm_scale, exp_scale, LP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr, SCALE_POW2: tl.constexpr,
                  IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    lse2 = lse * 1.4426950408889634
    for start_n in range(lo, hi, BLOCK_N):
        p, dp, k = _block_p_dp(q, do, lse2, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                               start_n, sm_scale, exp_scale, HEAD_DIM, BLOCK_N, MASKED, CAUSAL, PAPER, SCALE_POW2,
                               IS_BF16, EXPLICIT, TMA)
        ds = p * (dp - delta[:, None])
        dq = _mma(_lp_operand(ds, LP, IS_BF16, EXPLICIT), k, dq, EXPLICIT)
    return dq


@triton.jit
def _exact_delta_tiles(num, den, q, do, lse, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                       lo, hi, sm_scale, exp_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                       MASKED: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr, SCALE_POW2: tl.constexpr,
                       IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """Add rowsum(P * dP) and rowsum(P) of key tiles [lo, hi) to one query tile's FP32 sums, tile after tile."""
    lse2 = lse * 1.4426950408889634
    for start_n in range(lo, hi, BLOCK_N):
        p, dp, _k = _block_p_dp(q, do, lse2, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                                start_n, sm_scale, exp_scale, HEAD_DIM, BLOCK_N, MASKED, CAUSAL, PAPER, SCALE_POW2,
                                IS_BF16, EXPLICIT, False)
        num += tl.sum(p * dp, 1)
        den += tl.sum(p, 1)
    return num, den


@triton.jit
def _bwd_delta_exact_kernel(Q, K, V, DO, LSE, DELTA, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh,
                            stride_kt, stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, H, GROUP,
                            T, exp_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr,
                            SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """delta_exact = rowsum(P * dP) / rowsum(P) of one query tile of one head, in FP32: the backward's own P (as the
    dQ launch recomputes it) against dP = dO V^T, key tile by key tile (fix=exact_delta's delta; the reference delta
    of delta_reference=exact; why the division: ``kernels.reference.exact_delta``). Two matrix products per tile
    pair, like dQ's loop without its third."""
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < T
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0)
    q = _loaded_operand(q, EXPLICIT)
    do = _loaded_operand(do, EXPLICIT)
    hk = h // GROUP
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    num = tl.zeros([BLOCK_M], tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    if CAUSAL:
        full_hi = (start_m // BLOCK_N) * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, T)
    else:
        full_hi = (T // BLOCK_N) * BLOCK_N
        hi = T
    if start_m + BLOCK_M <= T:
        num, den = _exact_delta_tiles(num, den, q, do, lse, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows,
                                      offs_d, T, 0, full_hi, sm_scale, exp_scale, HEAD_DIM, BLOCK_N, False, CAUSAL,
                                      PAPER, SCALE_POW2, IS_BF16, EXPLICIT)
    else:
        num, den = _exact_delta_tiles(num, den, q, do, lse, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows,
                                      offs_d, T, 0, full_hi, sm_scale, exp_scale, HEAD_DIM, BLOCK_N, True, CAUSAL,
                                      PAPER, SCALE_POW2, IS_BF16, EXPLICIT)
    num, den = _exact_delta_tiles(num, den, q, do, lse, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows,
                                  offs_d, T, full_hi, hi, sm_scale, exp_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, PAPER,
                                  SCALE_POW2, IS_BF16, EXPLICIT)
    den = tl.where(den == 0.0, 1.0, den)  # rows past T only
    if EXPLICIT:
        delta = num / den
    else:
        delta = tl.math.div_rn(num, den)
    tl.store(DELTA + bh * T + rows, delta, mask=row_ok)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                   stride_vb, stride_vh, stride_vt, stride_dob, stride_doh, stride_dot, stride_dqb, stride_dqh,
                   stride_dqt, H, GROUP, T, exp_scale, sm_scale, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr,
                   SCALE_POW2: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr, TMA: tl.constexpr):
    """dQ of one query tile of one head. TMA: K and V are 4-D tensor descriptors (``_kv_descriptors``), not
    pointers; their tiles then come through the TMA unit (``set_tma(True)``: 1.3-1.6x faster in a probe copy of
    this loop on the H200, but 2-3% slower than the pointer loads in this kernel: docs/attention-kernel.md,
    "Speed")."""
    LP: tl.constexpr = DQ.dtype.element_ty
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < T
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dot + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)
    q = _loaded_operand(q, EXPLICIT)
    do = _loaded_operand(do, EXPLICIT)
    hk = h // GROUP
    if TMA:
        k_base = K  # unused: the descriptors address the tiles
        v_base = V
    else:
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        full_hi = (start_m // BLOCK_N) * BLOCK_N
        hi = tl.minimum(start_m + BLOCK_M, T)
    else:
        full_hi = (T // BLOCK_N) * BLOCK_N
        hi = T
    if start_m + BLOCK_M <= T:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                           0, full_hi, sm_scale, exp_scale, LP, HEAD_DIM, BLOCK_N, False, CAUSAL, PAPER, SCALE_POW2,
                           IS_BF16, EXPLICIT, TMA)
    else:
        dq = _bwd_dq_tiles(dq, q, do, lse, delta, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                           0, full_hi, sm_scale, exp_scale, LP, HEAD_DIM, BLOCK_N, True, CAUSAL, PAPER, SCALE_POW2,
                           IS_BF16, EXPLICIT, TMA)
    dq = _bwd_dq_tiles(dq, q, do, lse, delta, K, V, b, hk, k_base, v_base, stride_kt, stride_vt, rows, offs_d, T,
                       full_hi, hi, sm_scale, exp_scale, LP, HEAD_DIM, BLOCK_N, True, CAUSAL, PAPER, SCALE_POW2,
                       IS_BF16, EXPLICIT, TMA)
    dq = dq * sm_scale
    if EXPLICIT:
        dq = _round_lp(dq, IS_BF16, EXPLICIT)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :], dq.to(LP),
             mask=row_ok[:, None])


@triton.jit
def _bwd_dq_finish_kernel(DQ32, DQ, stride_dqb, stride_dqh, stride_dqt, H, T, sm_scale, HEAD_DIM: tl.constexpr,
                          BLOCK_M: tl.constexpr, IS_BF16: tl.constexpr, EXPLICIT: tl.constexpr):
    """dQ = LP(scale * the FP32 sum of the atomic backward's shares): the rounding the deterministic dQ launch makes
    at its end (DQ32 contiguous (B, H, T, head_dim); DQ laid out like q)."""
    LP: tl.constexpr = DQ.dtype.element_ty
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < T
    dq = _row_tile(DQ32, b, h, H * T * HEAD_DIM, T * HEAD_DIM, HEAD_DIM, rows, offs_d, ok) * sm_scale
    if EXPLICIT:
        dq = _round_lp(dq, IS_BF16, EXPLICIT)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqt + offs_d[None, :], dq.to(LP), mask=ok)


# ----------------------------------------------------------------------------------------------------------------
# Launch configuration: autotuned on the GPU, fixed when interpreting or when a call passes autotune=False
# ----------------------------------------------------------------------------------------------------------------

FIXED_FWD = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
FIXED_DKDV = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
FIXED_DQ = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


_FWD_KEY = ["T", "HEAD_DIM", "CAUSAL", "PAPER", "PAPER_TILE", "FIX", "IS_BF16"]
_BWD_KEY = ["T", "HEAD_DIM", "CAUSAL", "PAPER", "IS_BF16"]
_DKDV_KEY = _BWD_KEY + ["ATOMIC_DQ", "DQ_TMA"]
_DQ_KEY = _BWD_KEY + ["TMA"]
# (BLOCK_M, BLOCK_N, num_warps, num_stages, head dims the config is tried for; the others are pruned before they are
# compiled). The forward needs BLOCK_M to be a multiple of BLOCK_N (its causal split into full and diagonal tiles),
# and in rounding=paper a BLOCK_N no larger than the paper tile (its blocks must not straddle two tiles).
_ALL_D = (16, 32, 64, 128)
_FWD_CONFIGS = [(128, 64, 4, 3, _ALL_D), (128, 128, 8, 3, _ALL_D), (128, 64, 8, 3, _ALL_D), (64, 64, 4, 3, _ALL_D)]
# Head dim 128 also tries shallower pipelines and 8 warps, which won there and lost at head dim 64; the 64 x 64
# forward, the 2-stage 64 x 64 / 32 x 64 dK/dV and the 32-key dQ tiles come from a sweep of benchmarks.attention_tiles
# (the measurements and their commands: docs/attention-kernel.md, "Speed").
_D128 = (128,)
_DKDV_CONFIGS = [(32, 128, 4, 3, _ALL_D), (64, 128, 8, 3, _ALL_D), (64, 64, 4, 3, _ALL_D),
                 (64, 64, 4, 2, _ALL_D), (32, 64, 4, 2, _ALL_D),
                 (64, 128, 8, 2, _D128), (64, 64, 8, 2, _D128), (32, 64, 4, 3, _D128)]
_DQ_CONFIGS = [(128, 32, 4, 3, _ALL_D), (128, 64, 8, 3, _ALL_D), (64, 64, 4, 3, _ALL_D), (64, 32, 4, 3, _ALL_D),
               (128, 32, 8, 3, _ALL_D),
               (128, 64, 8, 2, _D128), (64, 64, 8, 2, _D128)]


def _set_descriptor_blocks(args, cfg: dict) -> None:
    """The tensor descriptors in a launch's arguments address rows of one (batch, head): key rows (dQ's k and v, a
    block of BLOCK_N) or query rows (the atomic backward's FP32 dQ, BLOCK_M). Their block is set for the
    configuration ``cfg`` about to run (the descriptor's block shape is part of the binary)."""
    for arg in args:
        if _is_descriptor(arg):
            arg.block_shape[2] = cfg[arg.rows_key]


def _descriptor_pre_hook(nargs: dict) -> None:
    """Autotuner pre-hook: ``_set_descriptor_blocks`` for the configuration being timed (nargs holds its tiles)."""
    _set_descriptor_blocks(nargs.values(), nargs)


def _uses_descriptors(meta: dict) -> bool:
    return bool(meta.get("TMA") or meta.get("DQ_TMA"))


def _configs(shapes):
    out = []
    for bm, bn, w, st, dims in shapes:
        cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st, pre_hook=_descriptor_pre_hook)
        cfg.head_dims = dims  # read by _prune_configs only
        out.append(cfg)
    return out


def _prune_configs(configs, named_args, **kwargs):
    meta = {**named_args, **kwargs}
    dim = meta["HEAD_DIM"]
    kept = [c for c in configs if dim in getattr(c, "head_dims", _ALL_D)] or configs
    paper_tile = meta.get("PAPER_TILE", 0)  # forward only
    if meta["PAPER"] and paper_tile:
        kept = [c for c in kept if c.kwargs["BLOCK_N"] <= paper_tile]
    return kept


_PRUNE = {"early_config_prune": _prune_configs}

# Launch without Triton's per-call binding (see _Kernel); ``set_fast_launch(False)`` launches every call through
# Triton's JIT entry point instead, e.g. to compare the two (benchmarks.host_overhead). Same bits either way.
FAST_LAUNCH = True
# dQ's k and v tiles (and the atomic backward's dQ reduction) through TMA descriptors where the GPU and the tensors
# allow it (``_tma_ok``), after ``set_tma(True)``; off by default, since the pointer path was faster in this kernel
# on the H200 (docs/attention-kernel.md, "Speed"). Same bits either way (tests/gpu/test_attention_gpu.py).
TMA = False


def set_tma(enabled: bool) -> bool:
    """Load dQ's k/v tiles (and, in the atomic backward, add dQ's shares) through TMA descriptors where possible
    (True) or through pointers (False, the default: measured faster in both launches on the H200,
    docs/attention-kernel.md "Speed"); returns the previous setting. A host-side choice for this process: the
    deterministic backward's results are identical either way."""
    global TMA
    previous, TMA = TMA, bool(enabled)
    return previous



def set_fast_launch(enabled: bool) -> bool:
    """Launch through the kernels' cached binaries (True, the default) or through Triton's JIT entry point on every
    call (False); returns the previous setting. A host-side choice for this process: results are identical."""
    global FAST_LAUNCH
    previous, FAST_LAUNCH = FAST_LAUNCH, bool(enabled)
    return previous


_MAX_BINARIES = 4096  # launch-cache entries per kernel before the cache is emptied (distinct shapes x layouts)


class _Kernel:
    """One Triton kernel and how it is launched: a fixed configuration (interpreter, a launch without a tuning key,
    i.e. autotune=False, or a kernel without ``configs``) or the autotuner's choice per tuning key, remembered after
    the first call of the key.

    Launching through ``JITFunction.__getitem__`` costs tens of microseconds of host time per call: Triton binds the
    arguments, works out their specialisation (16-byte alignment of pointers; integers equal to 1, divisible by 16 or
    wider than 32 bits), hashes it with the options and looks the binary up. Its result depends only on the device,
    the constexprs, the options, the integer values, the pointers' alignment and dtypes, so after the first launch of a
    combination (and the tensors' dtypes: the delta kernel reads a bf16 or an FP32 O under the same constexprs) this
    class keeps the compiled binary and calls its launcher directly. Launch hooks (set by profilers
    such as Proton) and the interpreter take Triton's own path.

    Arguments come as three tuples in the kernel's order: tensors, then integers, then floats, then the constexprs
    (every kernel here declares them in that order).
    """

    def __init__(self, fn, fixed: dict, configs=None, key=None):
        self.fn = fn
        self.fixed = fixed
        self.tuner = (triton.autotune(_configs(configs), key=key, prune_configs_by=_PRUNE)(fn) if configs else None)
        self.chosen: dict = {}  # tuning key -> the autotuner's configuration (constexprs and launch options)
        self.binaries: dict = {}  # launch key -> (launcher, function handle, packed metadata, constexpr values)

    def __call__(self, grid, tensors: tuple, ints: tuple, floats: tuple, meta: dict, tune_key=None) -> dict:
        """Launch on grid(cfg) and return the configuration cfg used; ``tune_key`` None: the fixed configuration."""
        if self.tuner is None or tune_key is None or INTERPRET:
            cfg = self.fixed
        else:
            cfg = self.chosen.get(tune_key)
            if cfg is None:  # first call of the key: the autotuner times its configurations and launches the best
                self.tuner[lambda c: grid(c)](*tensors, *ints, *floats, **meta)
                cfg = self.chosen[tune_key] = dict(self.tuner.best_config.all_kwargs())
                if not meta.get("ATOMIC_DQ"):
                    return cfg
                # every timing run added its dQ shares too: start the buffer from zeros again and launch for real
                dq32 = tensors[self.fn.arg_names.index("DQ32")]
                (dq32.base if _is_descriptor(dq32) else dq32).zero_()
        g = grid(cfg)
        if _uses_descriptors(meta):
            _set_descriptor_blocks(tensors, cfg)
        if INTERPRET or not FAST_LAUNCH or _launch_hooks_set():
            self.fn[g](*tensors, *ints, *floats, **meta, **cfg)
            return cfg
        device = tensors[0].device.index  # a tensor in every launch (descriptors come later: dQ's k and v)
        key = (device, tuple(meta.values()), tuple(cfg.values()), ints, tuple(_arg_key(t) for t in tensors))
        binary = self.binaries.get(key)
        if binary is None:
            compiled = self.fn[g](*tensors, *ints, *floats, **meta, **cfg)  # compiles (or loads) and launches
            if hasattr(compiled, "result"):  # asynchronous compilation mode
                compiled = compiled.result()
            constexprs = {**meta, **cfg}
            launcher = compiled.run  # also loads the binary's handles
            if len(self.binaries) >= _MAX_BINARIES:
                self.binaries.clear()
            self.binaries[key] = (launcher, compiled.function, compiled.packed_metadata,
                                  tuple(constexprs[self.fn.arg_names[i]] for i in self.fn.constexprs))
            return cfg
        launcher, function, packed_metadata, constexpr_values = binary
        launcher(g[0], g[1], g[2] if len(g) > 2 else 1, torch._C._cuda_getCurrentRawStream(device), function,
                 packed_metadata, None, None, None, *tensors, *ints, *floats, *constexpr_values)
        return cfg


def _is_descriptor(arg) -> bool:
    return TensorDescriptor is not None and isinstance(arg, TensorDescriptor)


def _arg_key(arg):
    """What of a tensor argument selects the binary: its dtype and 16-byte alignment; a descriptor's block shape."""
    if _is_descriptor(arg):
        return "desc", arg.base.dtype, tuple(arg.block_shape)
    return arg.dtype, arg.data_ptr() & 15 == 0


def _launch_hooks_set() -> bool:
    """Whether a launch hook is registered (Triton >= 3.5 keeps an always-present, possibly empty hook chain)."""
    hook = triton.knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


FWD = _Kernel(_fwd_kernel, FIXED_FWD, _FWD_CONFIGS, _FWD_KEY)
# Both delta launches without FMA contraction: then gain 0 gives fp32_output's delta bit for bit on the GPU too
# (with FMAs in the plain launch, 1-21 gradient elements differed: docs/device-runs/2026-12-01-house/README.md)
DELTA = _Kernel(_bwd_delta_kernel, dict(BLOCK_M=64, enable_fp_fusion=False))
DELTA_GAIN = _Kernel(_bwd_delta_gain_kernel, dict(BLOCK_M=64, enable_fp_fusion=False))
DELTA_EXACT = _Kernel(_bwd_delta_exact_kernel, FIXED_DQ, _DQ_CONFIGS, _BWD_KEY)  # dQ's loop: dQ's tiles
DKDV = _Kernel(_bwd_dkdv_kernel, FIXED_DKDV, _DKDV_CONFIGS, _DKDV_KEY)
DQ = _Kernel(_bwd_dq_kernel, FIXED_DQ, _DQ_CONFIGS, _DQ_KEY)
DQ_FINISH = _Kernel(_bwd_dq_finish_kernel, dict(BLOCK_M=64))


# The autotuned kernels by the name a tuning record uses for them.
TUNED = {"forward": FWD, "delta_exact": DELTA_EXACT, "dkdv": DKDV, "dq": DQ}


def _device_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _encode_key(key: tuple) -> list:
    """A tuning key as JSON-able values (its torch dtype as "dtype:<name>")."""
    return [f"dtype:{str(v).removeprefix('torch.')}" if isinstance(v, torch.dtype) else v for v in key]


def _decode_key(values: list) -> tuple:
    return tuple(getattr(torch, v[len("dtype:"):]) if isinstance(v, str) and v.startswith("dtype:") else v
                 for v in values)


def tuning_record() -> dict:
    """The autotuner's choices of this process so far (tile sizes, warps, stages per tuning key of each kernel), and
    the GPU they were timed on. The tile decides which running maximum P is rounded against, so the choice is part of
    a run's numerics: a checkpoint keeps it and a resumed process installs it (``install_tuning``) instead of timing
    the candidates again, perhaps to another answer."""
    return {"device": _device_name(),
            "choices": {name: [[_encode_key(key), dict(cfg)] for key, cfg in kernel.chosen.items()]
                        for name, kernel in TUNED.items() if kernel.chosen}}


def install_tuning(record: dict | None) -> str:
    """Make the choices of ``record`` (``tuning_record``'s, e.g. from a checkpoint) this process's, so that its
    launches use the recorded tiles for those keys; keys not in it are timed as usual. Returns what it did in words
    ("" for an empty record). A record from another GPU model is not installed (its tiles were timed there and may
    not fit this one): the kernels choose again, which the message says may change the numerics."""
    choices = (record or {}).get("choices") or {}
    if not choices:
        return ""
    here, there = _device_name(), record.get("device")
    if here != there:
        return (f"the attention kernels' tiles were autotuned on {there}, this is {here}: they are chosen again, "
                f"so the numerics may differ from the recorded run's from here on")
    installed = 0
    for name, entries in choices.items():
        kernel = TUNED.get(name)
        if kernel is None:  # a kernel of another version of this module
            continue
        for key, cfg in entries:
            kernel.chosen[_decode_key(key)] = dict(cfg)
            installed += 1
    return f"installed {installed} recorded attention-kernel tile choice(s) (autotuned on {there})"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a constexpr function: slower on the host


# ----------------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------------


def _check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if INTERPRET and t.device.type != "cpu":
            raise RuntimeError("TRITON_INTERPRET=1 was set when kernels.triton_flash was imported: the interpreter "
                               "runs on CPU tensors only. Unset it for CUDA tensors (in a fresh process).")
        if not INTERPRET and t.device.type != "cuda":
            raise RuntimeError("kernels.flash_attention needs CUDA tensors. On CPU use kernels.reference_attention "
                               "(same numerics), or set TRITON_INTERPRET=1 before importing kernels.triton_flash "
                               "(tests only: the interpreter is slow).")


_DESCRIPTOR_ATOMICS = hasattr(getattr(tl.core, "tensor_descriptor_base", None), "atomic_add")  # TMA reductions
_TMA_DEVICES: dict = {}  # CUDA device index -> whether it has a TMA unit (sm_90 and later)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether dQ may read these (k, v) through TMA descriptors: enabled, compiled (not interpreted), a GPU with TMA,
    16-byte aligned base addresses and positive strides that are multiples of 16 bytes (the last one 1)."""
    if not TMA or INTERPRET or TensorDescriptor is None:
        return False
    device = tensors[0].device.index
    if device not in _TMA_DEVICES:
        _TMA_DEVICES[device] = torch.cuda.get_device_capability(device)[0] >= 9
    if not _TMA_DEVICES[device]:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(st <= 0 or st * size % 16 for st in t.stride()[:-1]):
            return False
    return True


def _rows_descriptor(t: torch.Tensor, rows_key: str):
    """A 4-D (batch, heads, seq, head_dim) TMA descriptor of t whose block is one head's rows, as many as the
    launch configuration's ``rows_key`` (BLOCK_N or BLOCK_M), set per configuration by ``_set_descriptor_blocks``."""
    desc = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, t.shape[-1]])
    desc.rows_key = rows_key
    return desc


def _kv_descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of k and v for the dQ launch: blocks of BLOCK_N key rows."""
    return _rows_descriptor(k, "BLOCK_N"), _rows_descriptor(v, "BLOCK_N")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _like(t: torch.Tensor, dtype=None, fill: float | None = None) -> torch.Tensor:
    """An output laid out like input t (empty_like keeps a dense tensor's stride order, else it is contiguous),
    uninitialised or filled with ``fill``.

    A model's q, k, v are (B, T, H, D) projections seen as (B, H, T, D): O in that layout makes the model's
    transpose back to (B, T, H * D) a free view, and gradients in that layout need no copy before the projections'
    backward. The fake kernels allocate through here too, so the compiler sees the real strides."""
    if fill is None:
        return torch.empty_like(t, dtype=dtype)
    return torch.full_like(t, fill, dtype=dtype)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
            noise_keys: torch.Tensor | None = None) -> Numerics:
    """Check one call (tensors, devices, noise keys) and return its numerics; ``forward`` and ``backward`` take them."""
    nm = check_args(q, k, v, settings, _KERNEL_DTYPES, noise_keys)
    _check_device(q, k, v)
    return nm


def forward_outputs(q: torch.Tensor, settings: AttentionSettings):
    """(O like q, LSE (B, H, T) FP32, FP32 O like q where the settings keep one, the mode's own O like q under the
    output stress; the last two empty tensors otherwise), as ``forward`` allocates them (the custom op's fake
    kernel too, so that the compiler sees the real strides)."""
    q = _last_dim_contiguous(q)
    return (*_forward_outputs(q, settings.keeps_fp32_output, settings.out_fill),
            _mode_output(q, settings.output_amplified, settings.out_fill))


def backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings):
    """(dq, dk, dv) as ``backward`` allocates them."""
    return _backward_outputs(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
                             settings.out_fill)


def _forward_outputs(q: torch.Tensor, keeps_fp32_output: bool, fill: float | None = None):
    """(O like q, LSE (B, H, T) FP32, FP32 O like q for fix=fp32_output else an empty tensor); q last-dim contiguous.
    O and the FP32 O have the same strides (the kernel addresses both with O's)."""
    bsz, heads, seq, _ = q.shape
    out = _like(q, fill=fill)
    lse = _new((bsz, heads, seq), torch.float32, q.device, fill)
    o32 = _like(q, torch.float32, fill) if keeps_fp32_output else _new((0,), torch.float32, q.device)
    return out, lse, o32


def _mode_output(q: torch.Tensor, output_amplified: bool, fill: float | None = None) -> torch.Tensor:
    """The mode's own O, like q (the forward returns the amplified one), under the output stress; else empty."""
    return _like(q, fill=fill) if output_amplified else _new((0,), q.dtype, q.device)


class _Launch:
    """One launch, prepared: the kernel, its grid (a function of the configuration) and its arguments. Calling it
    launches with the fixed or tuned configuration; ``benchmarks.attention_tiles`` launches it with others."""

    __slots__ = ("kernel", "grid", "tensors", "ints", "floats", "meta", "tune_key")

    def __init__(self, kernel: _Kernel, grid, tensors: tuple, ints: tuple, floats: tuple, meta: dict, tune_key=None):
        self.kernel, self.grid, self.tensors, self.ints, self.floats = kernel, grid, tensors, ints, floats
        self.meta, self.tune_key = meta, tune_key

    def __call__(self) -> dict:
        return self.kernel(self.grid, self.tensors, self.ints, self.floats, self.meta, self.tune_key)

    def with_config(self, cfg: dict):
        """Launch with configuration cfg (constexprs BLOCK_M/BLOCK_N and options) through Triton's own path."""
        if _uses_descriptors(self.meta):
            _set_descriptor_blocks(self.tensors, cfg)
        return self.kernel.fn[self.grid(cfg)](*self.tensors, *self.ints, *self.floats, **self.meta, **cfg)


def _keys_arg(nm: Numerics, noise_keys, bsz: int, device) -> torch.Tensor:
    """The noise keys a launch reads: the given keys (contiguous), zeros for None, an empty tensor where unused."""
    if not nm.needs_noise_keys:
        return torch.empty(0, dtype=torch.int64, device=device)  # never read (the launch's FIX / RANDOM)
    if noise_keys is None:
        return torch.zeros(bsz, dtype=torch.int64, device=device)
    return noise_keys.contiguous()


def _forward_launch(q, k, v, settings: AttentionSettings, nm: Numerics, noise_keys: torch.Tensor | None = None):
    """(the forward launch, O, LSE, FP32 O, the mode's O); q, k, v last-dim contiguous. ``settings.autotune``
    False: the fixed tiles; ``settings.out_fill``: what the outputs start filled with (None: uninitialised)."""
    bsz, heads, seq, dim = q.shape
    causal = settings.causal
    out, lse, o32 = _forward_outputs(q, nm.keeps_fp32_output, settings.out_fill)
    o_mode = _mode_output(q, nm.output_amplified, settings.out_fill)
    keys = _keys_arg(nm, noise_keys, bsz, q.device)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    ints = (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1], os_[2], heads,
            heads // k.shape[1], seq, settings.head_offset, settings.total_heads or heads)
    floats = (nm.score_scale, nm.exp_scale, nm.shift_scale, nm.beta, nm.eps_cmp, nm.output_gain)
    meta = dict(HEAD_DIM=dim, CAUSAL=causal, PAPER=nm.paper, PAPER_TILE=nm.paper_tile, FIX=nm.fix,
                SCALE_POW2=nm.score_rounds_once, IS_BF16=q.dtype == torch.bfloat16, EXPLICIT=INTERPRET,
                STORE_O32=nm.keeps_fp32_output, OUT_AMP=nm.output_amplified, OUT_RANDOM=nm.output_random)
    rows = bsz * heads
    tune_key = ("fwd", seq, dim, causal, nm.paper, nm.paper_tile, nm.fix, q.dtype, nm.keeps_fp32_output,
                nm.output_amplified)
    launch = _Launch(FWD, lambda c: (_cdiv(seq, c["BLOCK_M"]), rows), (q, k, v, out, o32, o_mode, lse, keys), ints,
                     floats, meta, tune_key if settings.autotune else None)
    return launch, out, lse, o32, o_mode


def forward(q, k, v, settings: AttentionSettings, nm: Numerics, noise_keys: torch.Tensor | None = None):
    """The forward launch: (O, LSE, FP32 O, the mode's O; the last two empty where not kept), allocated as
    ``forward_outputs`` says; ``nm`` from ``prepare``. q's head h is the model's head settings.head_offset + h of
    settings.total_heads."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    launch, *outputs = _forward_launch(q, k, v, settings, nm, noise_keys)
    launch()
    return tuple(outputs)


def _backward_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fill: float | None = None):
    """(dq, dk, dv), each laid out like its input; q, k, v last-dim contiguous."""
    return _like(q, fill=fill), _like(k, fill=fill), _like(v, fill=fill)


def _delta_launch(d_out, o_saved, nm: Numerics, o32=None, noise_keys=None, head_offset: int = 0,
                  fill: float | None = None, exact: torch.Tensor | None = None):
    """(the launch of delta = rowsum(dO * O_saved), the FP32 (B, H, T) delta it fills): the plain delta, or the
    amplified one (``nm.amplified``), which also reads the forward's FP32 O ``o32`` (delta_reference=fp32_output) or
    ``exact``, the exact pass's delta (delta_reference=exact, and delta_mode of fix=exact_delta; ``_exact_launch``
    fills it first), and ``noise_keys`` for random signs. Shared by both backward kernels (kernels.gluon_flash's
    too). fix=exact_delta without the stress has no launch here: its delta is the exact pass's."""
    bsz, heads, seq, dim = d_out.shape
    delta = _new((bsz, heads, seq), torch.float32, d_out.device, fill)
    os_, ds = o_saved.stride(), d_out.stride()
    q_rows = bsz * heads
    if nm.amplified:
        ref_exact = nm.delta_exact_ref
        if nm.exact_pass and exact is None:
            raise ValueError("fix=exact_delta or delta_reference='exact' needs the exact pass's delta (exact)")
        if not ref_exact and (o32 is None or o32.numel() == 0):
            raise ValueError("delta_gain != 1 or delta_sign='random' needs the forward's FP32 O (o32)")
        o32 = o_saved if ref_exact else _last_dim_contiguous(o32)  # with the exact reference: never read
        s32 = o32.stride()
        keys = _keys_arg(nm, noise_keys, bsz, d_out.device)
        launch = _Launch(DELTA_GAIN, lambda c: (_cdiv(seq, c["BLOCK_M"]), q_rows),
                         (o_saved, o32, d_out, keys, delta if exact is None else exact, delta),
                         (os_[0], os_[1], os_[2], s32[0], s32[1], s32[2], ds[0], ds[1], ds[2], heads, seq,
                          int(head_offset)), (nm.delta_gain,),
                         dict(HEAD_DIM=dim, RANDOM=nm.delta_random, MODE_EXACT=nm.fix == FIX_EXACT_DELTA,
                              REF_EXACT=ref_exact))
    else:
        launch = _Launch(DELTA, lambda c: (_cdiv(seq, c["BLOCK_M"]), q_rows), (o_saved, d_out, delta),
                         (os_[0], os_[1], os_[2], ds[0], ds[1], ds[2], heads, seq), (), dict(HEAD_DIM=dim))
    return launch, delta


def dq_finish_launch(dq32: torch.Tensor, dq: torch.Tensor, nm: Numerics) -> _Launch:
    """The launch that writes dQ = LP(scale * dq32) from the FP32 sums of an accumulating backward (the atomic
    dQ of this kernel, kernels.gluon_flash's fused backward); dq32 contiguous (B, H, T, head_dim), dq like q."""
    bsz, heads, seq, dim = dq.shape
    dqs = dq.stride()
    return _Launch(DQ_FINISH, lambda c: (_cdiv(seq, c["BLOCK_M"]), bsz * heads), (dq32, dq),
                   (dqs[0], dqs[1], dqs[2], heads, seq), (nm.sm_scale,),
                   dict(HEAD_DIM=dim, IS_BF16=dq.dtype == torch.bfloat16, EXPLICIT=INTERPRET))


def _backward_launches(d_out, q, k, v, o_saved, lse, settings: AttentionSettings, nm: Numerics, o32=None,
                       noise_keys=None):
    """((delta launches, dK/dV, dQ launches, in that order), (dq, dk, dv)); every tensor last-dim contiguous, d_out in
    q's dtype. The delta launch is rowsum(dO * O_saved), or for fix=exact_delta the exact pass (rowsum(P * dP) /
    rowsum(P), a query-tile launch over the key tiles). The amplified path (``nm.amplified``) replaces it by the gain
    launch, which also reads the forward's FP32 O ``o32`` (delta_reference=fp32_output) or the exact pass's delta,
    launched before it (delta_reference=exact, or fix=exact_delta), and ``noise_keys`` for random signs.
    ``settings.autotune`` and ``out_fill`` as in the forward. ``settings.deterministic`` False: the dK/dV launch also
    adds dQ's shares into an FP32 buffer with atomics, and the third launch only scales and rounds it."""
    causal, autotune, fill, head_offset = settings.causal, settings.autotune, settings.out_fill, settings.head_offset
    bsz, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    ds = d_out.stride()
    q_rows, kv_rows = bsz * heads, bsz * kv_heads
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    inputs = (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], ds[0], ds[1], ds[2])
    tail = (heads, heads // kv_heads, seq)
    floats = (nm.exp_scale, nm.sm_scale)
    meta = dict(HEAD_DIM=dim, CAUSAL=causal, PAPER=nm.paper, SCALE_POW2=nm.score_rounds_once,
                IS_BF16=q.dtype == torch.bfloat16, EXPLICIT=INTERPRET)
    key = (seq, dim, causal, nm.paper, q.dtype)
    if nm.exact_pass:  # rowsum(P * dP) / rowsum(P): the delta itself, or an input of the gain launch
        exact = _new((bsz, heads, seq), torch.float32, q.device, fill)
        exact_launch = _Launch(DELTA_EXACT, lambda c: (_cdiv(seq, c["BLOCK_M"]), q_rows),
                               (q, k, v, d_out, lse, exact), inputs + tail, floats, meta,
                               ("exact",) + key if autotune else None)
        delta_launches = [exact_launch]
        delta = exact
        if nm.amplified:
            gain_launch, delta = _delta_launch(d_out, o_saved, nm, o32, noise_keys, head_offset, fill, exact)
            delta_launches.append(gain_launch)
    else:
        delta_launch, delta = _delta_launch(d_out, o_saved, nm, o32, noise_keys, head_offset, fill)
        delta_launches = [delta_launch]
    dq, dk, dv = _backward_outputs(q, k, v, fill)
    dqs, dks, dvs = dq.stride(), dk.stride(), dv.stride()
    atomic = not settings.deterministic
    if atomic:  # dQ's FP32 sums, filled by the dK/dV launch's atomics (zeros whatever ``fill`` says)
        dq32 = torch.zeros((bsz, heads, seq, dim), dtype=torch.float32, device=q.device)
        dq_tma = _DESCRIPTOR_ATOMICS and _tma_ok(dq32)
        dq32_arg = _rows_descriptor(dq32, "BLOCK_M") if dq_tma else dq32
    else:
        dq32 = dq32_arg = torch.empty(0, dtype=torch.float32, device=q.device)  # never read
        dq_tma = False
    dkdv_launch = _Launch(DKDV, lambda c: (_cdiv(seq, c["BLOCK_N"]), kv_rows),
                          (q, k, v, d_out, lse, delta, dk, dv, dq32_arg),
                          inputs + (dks[0], dks[1], dks[2], dvs[0], dvs[1], dvs[2]) + tail, floats,
                          {**meta, "ATOMIC_DQ": atomic, "DQ_TMA": dq_tma},
                          (("dkdv", atomic, dq_tma) + key) if autotune else None)
    if atomic:
        return (*delta_launches, dkdv_launch, dq_finish_launch(dq32, dq, nm)), (dq, dk, dv)
    tma = _tma_ok(k, v)
    k_arg, v_arg = _kv_descriptors(k, v) if tma else (k, v)
    dq_launch = _Launch(DQ, lambda c: (_cdiv(seq, c["BLOCK_M"]), q_rows), (q, k_arg, v_arg, d_out, lse, delta, dq),
                        inputs + (dqs[0], dqs[1], dqs[2]) + tail, floats, {**meta, "TMA": tma},
                        (("dq", tma) + key) if autotune else None)
    return (*delta_launches, dkdv_launch, dq_launch), (dq, dk, dv)


def backward(d_out, q, k, v, o_saved, lse, o32, settings: AttentionSettings, nm: Numerics, noise_keys=None):
    """The backward launches: (dq, dk, dv) laid out like q, k, v. ``o_saved``: the O that delta uses (the mode's O:
    LP, SR'd, or FP32 for fp32_output); ``o32``: the forward's FP32 O (the amplified delta path only, else None);
    ``nm`` from ``prepare``."""
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    if d_out.dtype != q.dtype:
        d_out = d_out.to(q.dtype)
    d_out, o_saved = _last_dim_contiguous(d_out), _last_dim_contiguous(o_saved)
    launches, grads = _backward_launches(d_out, q, k, v, o_saved, lse, settings, nm, o32, noise_keys)
    for launch in launches:
        launch()
    return grads
