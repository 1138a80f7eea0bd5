"""rounding=paper with the authors' tile size: the reference against a plain oracle of the issue's rounding points.

The oracle below is written from the description of the authors' code under CUDA BF16 autocast (issue 10), not from
the reference: per tile of ``tile`` keys (0: the whole row) and per row,

    S = bf16(bf16(q.k) * scale); m_new = max(m_old, tile max of S (shifted by the fix));
    P = exp(bf16(S - m_new)) in FP32; PV = bf16(bf16(P) V) with FP32 accumulation; rowsum(P) in FP32;
    alpha = exp(bf16(m_old - m_new)); l = bf16(alpha l + rowsum); O = bf16(bf16(O alpha) + PV);
    finally O = bf16(O / l), LSE = m + log l.

It rounds with torch's own casts (not ``kernels.rounding``), keeps a row's state untouched where a tile has no valid
key for it, and clamps the row sum at 1e-10 for the published rule. exp and log are evaluated as exp2(x log2 e)
and log2(x) ln 2, and the FP32 sums over a tile use the same torch primitives on the same shapes as the reference:
the comparison is about the rounding points, not about the last bit of a transcendental or a summation order.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels.rounding import safe_shift
from tests.attention_common import same_bits

LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def oracle(q, k, v, causal: bool, tile: int, fix: str = "none", beta: float = 2.0, eps: float = 1e-3):
    """(O as bf16, LSE in FP32) of the authors' numerics; q, k, v bf16 (batch, heads, seq, head_dim)."""
    bsz, heads, seq, dim = q.shape
    scale = float(torch.tensor(dim**-0.5, dtype=torch.float32))
    qf, kf, vf = q.float(), k.float(), v.float()
    o = torch.zeros(bsz, heads, seq, dim)
    l = torch.zeros(bsz, heads, seq, 1)
    m = torch.full((bsz, heads, seq, 1), float("-inf"))
    row = torch.arange(seq).view(seq, 1)
    bh = (torch.arange(bsz).view(bsz, 1, 1) * heads + torch.arange(heads).view(1, heads, 1)).unsqueeze(-1)
    tile = tile or seq
    for start in range(0, seq, tile):
        keys = torch.arange(start, min(start + tile, seq))
        valid = (keys.view(1, -1) <= row) if causal else torch.ones(seq, len(keys), dtype=torch.bool)
        has_key = valid.any(-1, keepdim=True)
        scores = bf16(bf16(qf @ kf[:, :, keys].transpose(-1, -2)) * scale)
        scores = torch.where(valid, scores, float("-inf"))
        r_m = scores.amax(-1, keepdim=True)
        tile_m = r_m
        if fix != "none":
            tied = ((r_m - scores) <= (max(eps, 2.0**-8) if fix == "dynamic_max" else eps)).sum(-1, keepdim=True) > 1
            if fix == "dynamic_max":
                tile_m = torch.where(tied, r_m + safe_shift(r_m, row.view(1, 1, seq, 1), bh), r_m)
            else:
                tile_m = torch.where(tied & (r_m > 0), bf16(beta * r_m), r_m)
                tile_m = torch.where(tied & (r_m < 0), 0.0, tile_m)
        m_new = torch.maximum(m, tile_m)
        p = torch.exp2(bf16(scores - m_new) * LOG2E)
        p = torch.where(valid, p, 0.0)
        row_sum = p.sum(-1, keepdim=True)
        if fix == "dynamic_max_published":
            row_sum = row_sum.clamp_min(1e-10)
        pv = bf16(bf16(p) @ vf[:, :, keys])
        alpha = torch.exp2(bf16(m - m_new) * LOG2E)
        new_l = bf16(alpha * l + row_sum)
        new_o = bf16(bf16(o * alpha) + pv)
        l = torch.where(has_key, new_l, l)
        o = torch.where(has_key, new_o, o)
        m = torch.where(has_key, m_new, m)
    out = bf16(o / l).to(torch.bfloat16)
    lse = (m + torch.log2(l) * LN2).squeeze(-1)
    return out, lse


def forward(q, k, v, causal, tile, fix="none"):
    from kernels.modes import AttentionSettings, check_args
    from kernels.reference import forward_core

    nm = check_args(q, k, v, AttentionSettings(rounding="paper", fix=fix, paper_block_keys=tile), (torch.bfloat16,))
    out, lse, _ = forward_core(q, k, v, causal, nm, 64)
    return out, lse


def inputs_with_ties(seq: int, heads: int = 2, dim: int = 64):
    """Gaussian q, k, v; a third of the keys are copies of 4 anchors (so many rows' maxima repeat, within a tile and
    across tiles), and rows with large scores (q = 2 x an anchor) make P_bar concentrated, as in the paper."""
    q = torch.randn(1, heads, seq, dim)
    k = torch.randn(1, heads, seq, dim)
    v = torch.randn(1, heads, seq, dim)
    anchors = torch.randn(1, heads, 4, dim)
    copied = torch.randperm(seq)[: seq // 3]
    k[:, :, copied] = anchors[:, :, torch.randint(4, (len(copied),))]
    strong = torch.randperm(seq)[: seq // 2]
    noise = 0.3 * torch.randn(1, heads, len(strong), dim)
    q[:, :, strong] = 2 * anchors[:, :, torch.randint(4, (len(strong),))] + noise
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("fix", ["none", "dynamic_max", "dynamic_max_published"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seq,tile", [(1024, 512), (300, 0), (400, 64), (200, 128)],
                         ids=["tile512", "whole-row", "tile64", "tile128-ragged"])
def test_reference_equals_the_oracle_bit_for_bit(seq, tile, causal, fix, seed):
    q, k, v = inputs_with_ties(seq)
    out, lse = forward(q, k, v, causal, tile, fix)
    want_out, want_lse = oracle(q, k, v, causal, tile, fix)
    msg = f"seed={seed} seq={seq} tile={tile}"
    assert same_bits(out, want_out), f"{msg}: O differs in {(out != want_out).sum()} elements"
    assert same_bits(lse, want_lse), f"{msg}: LSE differs"


def test_tile_size_matters_and_whole_row_is_one_tile(seed):
    """paper_block_keys >= seq is the whole row; a smaller tile gives other bits (more roundings of O and l)."""
    q, k, v = inputs_with_ties(256)
    whole = kernels.reference_attention(q, k, v, True, "paper", paper_block_keys=0)
    assert same_bits(whole, kernels.reference_attention(q, k, v, True, "paper", paper_block_keys=256))
    assert same_bits(whole, kernels.reference_attention(q, k, v, True, "paper"))  # default 512 > 256 keys
    assert not same_bits(whole, kernels.reference_attention(q, k, v, True, "paper", paper_block_keys=64))
    fa2 = kernels.reference_attention(q, k, v, True, "fa2")
    assert same_bits(fa2, kernels.reference_attention(q, k, v, True, "fa2", paper_block_keys=64)), "fa2 ignores it"


@pytest.mark.parametrize("bad", [32, 100, -64, 64.0, True])
def test_bad_paper_block_keys_is_refused(bad):
    q = torch.randn(1, 1, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="must be 0 .* or a power of two >= 64"):
        kernels.reference_attention(q, q, q, rounding="paper", paper_block_keys=bad)


def test_scores_are_rounded_twice(seed):
    """At head_dim 32 the scale 1/sqrt(32) is not a power of two: S = bf16(bf16(q.k) * scale) differs from the
    single rounding bf16(q.k * scale) on some scores, and the reference follows the double rounding."""
    q, k, v = inputs_with_ties(128, dim=32)
    out, lse = forward(q, k, v, False, 0)
    want_out, want_lse = oracle(q, k, v, False, 0)
    assert same_bits(out, want_out) and same_bits(lse, want_lse), f"seed={seed}"
    qk = q.float() @ k.float().transpose(-1, -2)
    scale = 32**-0.5
    assert (bf16(bf16(qk) * scale) != bf16(qk * scale)).any(), "the test needs scores where the two differ"
