"""The delta-bias monitor on crafted inputs: a persistent sign for rounding=paper/fix=none, none for the fixes.

Construction (causal, head_dim 64): four random anchor keys, each copied to two positions inside the first key tile,
so every later query row q = 1.5 * anchor + noise has its maximum score attained exactly twice and concentrated
attention (the other keys hold ~1e-3 of the weight, enough to set the sticky bits). Half of V's channels are
negative with one exponent ([-2, -1)) and dO is negative there: the paper's rounding biases O_bar negative on those
channels, so delta_lp - delta_hp is positive, draw after draw.
"""

import pytest
import torch

import kernels
from kernels.modes import AttentionSettings
from kernels.reference import exact_attention
from launcher.monitors.delta_bias import cosine, layer_delta_bias


pytestmark = pytest.mark.usefixtures("single_thread")


def crafted(seed, batch=2, heads=2, seq=128, dim=64, d_model=64):
    g = torch.Generator().manual_seed(seed)
    n_anchor = 4
    k = 0.5 * torch.randn(batch, heads, seq, dim, generator=g)
    anchors = torch.randn(batch, heads, n_anchor, dim, generator=g)
    anchors = anchors * (dim**0.5 / anchors.norm(dim=-1, keepdim=True))  # tied scores ~12
    for a in range(n_anchor):
        k[:, :, 2 * a] = anchors[:, :, a]
        k[:, :, 2 * a + 9] = anchors[:, :, a]
    q = 1.5 * anchors[:, :, torch.arange(seq) % n_anchor] + 0.5 * torch.randn(batch, heads, seq, dim, generator=g)
    half = dim // 2
    mag = 1 + torch.rand(batch, heads, seq, dim, generator=g)
    sign = torch.where(torch.rand(batch, heads, seq, dim, generator=g) < 0.5, -1.0, 1.0)
    v = torch.cat([-mag[..., :half], (sign * mag)[..., half:]], -1)
    dmag = 1 + torch.rand(batch, heads, seq, dim, generator=g)
    dsign = torch.where(torch.rand(batch, heads, seq, dim, generator=g) < 0.5, -1.0, 1.0)
    d_out = torch.cat([-dmag[..., :half], (dsign * dmag)[..., half:]], -1)
    x = torch.randn(batch, seq, d_model, generator=g)
    return (*(t.to(torch.bfloat16) for t in (q, k, v, d_out)), x)


def sums(rounding, fix, draws=5):
    out = []
    for seed in range(draws):
        q, k, v, d_out, x = crafted(seed)
        o = kernels.reference_attention(q, k, v, causal=True, rounding=rounding, fix=fix)
        out.append(layer_delta_bias(q, k, v, o, d_out, x, "reference", AttentionSettings(rounding=rounding, fix=fix))["sum"])
    return torch.stack(out)  # (draws, heads)


def test_paper_rounding_without_fix_has_a_persistent_positive_delta_bias():
    biased = sums("paper", "none")
    assert (biased > 0).all()
    assert biased.mean() > 5 * biased.std()


@pytest.mark.parametrize("fix", ["dynamic_max", "fp32_output"])
def test_fixes_remove_the_delta_bias(fix):
    biased = sums("paper", "none").mean()
    fixed = sums("paper", fix)
    assert fixed.mean().abs() < 0.2 * biased
    assert fixed.abs().max() < 0.5 * biased


def test_exact_attention_matches_sdpa_and_error_is_rank_structured():
    q, k, v, d_out, x = crafted(0, seq=32)
    o, p = exact_attention(q, k, v, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert torch.allclose(o, ref, atol=1e-10)
    assert torch.allclose(p.sum(-1), torch.ones_like(p.sum(-1)))
    # the W_Q gradient error has the layout of q_proj's rows per head and is zero when delta is exact
    out = layer_delta_bias(q, k, v, o.to(torch.float32), d_out, x, "sdpa")
    assert out["error"].shape == (2, 64, 64)


def test_successive_errors_of_a_persistent_bias_are_aligned():
    # Same tokens (q, k, v, X) and a new dO draw that keeps its sign on the imbalanced channels: the delta errors
    # keep their sign, the rank-1 terms (PK)^T X are shared, so the two W_Q gradient errors point the same way.
    q, k, v, d_out, x = crafted(0)
    o = kernels.reference_attention(q, k, v, causal=True, rounding="paper", fix="none")
    paper = AttentionSettings(rounding="paper")
    first = layer_delta_bias(q, k, v, o, d_out, x, "reference", paper)
    assert "dwq_cos" not in first
    second = layer_delta_bias(q, k, v, o, crafted(1)[3], x, "reference", paper, previous_error=first["error"])
    assert second["dwq_cos"].item() > 0.9
    assert (second["dwq_cos_head"] > 0.9).all()
    assert cosine(first["error"].flatten(), -first["error"].flatten(), (0,)).item() == pytest.approx(-1.0)
