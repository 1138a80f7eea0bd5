"""fix=exact_delta and delta_reference=exact in the reference (issue 34): delta = rowsum(P * dP) / rowsum(P) with
the backward's own P, against FP64 within a derived bound; V = 1 (O = 1, delta = rowsum(dO), dQ = dK = 0 exactly)
through every mode; the gain formula with the exact reference. The kernel's side: test_attention_triton_interp.py.

The bound. The exact pass sums n terms t_j = P_j * dP_j, dP_j = sum_c dO_c V_jc a head_dim-term FP32 dot product of
exact products (LP x LP fits FP32), and n terms P_j, then divides. Standard error analysis (Higham, Accuracy and
Stability of Numerical Algorithms, ch. 3), u = 2^-24, gamma(m) = m u / (1 - m u), for any summation order:
|fl(dP_j) - dP_j| <= gamma(D) A_j with A_j = sum_c |dO_c V_jc|; one more rounding for the product; the n-term sum
adds gamma(n - 1) of the sum of |terms|, so the numerator is off by at most gamma(n + D) T, T = sum_j P_j A_j; the
denominator (positive terms) by a relative gamma(n - 1), the division by u. Together
|delta_fp32 - delta_fp64| <= gamma(2n + D) T / rowsum(P), with P_j the backward's own FP32 P taken exactly. It
bounds the error relative to the terms' size, not to |delta|: where the terms cancel, delta's relative error can be
large, but never its error in units of T (a BF16 O in rowsum(dO * O) errs by up to 2^-8 of sum_c |dO_c O_c|).
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from kernels.modes import AttentionSettings, check_args
from kernels.reference import _expand_kv, _tile_probs, delta_of, exact_attention, exact_delta, forward_core
from kernels.rounding import LOG2E
from tests.attention_common import MODES, same_bits, tied_maxima_inputs

BF16 = (torch.bfloat16,)
U = 2.0**-24


def gamma(m: int) -> float:
    return m * U / (1 - m * U)


def fp64_rowsum_p_dp(q, k, v, d_out, lse, causal, nm, block_n=64):
    """(rowsum(P * dP) / rowsum(P) in FP64 with the backward's FP32 P taken exactly and dP = dO V^T exact, the
    bound's T / rowsum(P)) of LP tensors (k, v expanded)."""
    qf, kf = q.float(), k.float()
    lse_s = (lse * LOG2E).unsqueeze(-1)
    p = torch.cat([_tile_probs(qf, kf[:, :, n0:n0 + block_n], lse_s, n0, causal, nm, q.dtype)
                   for n0 in range(0, q.shape[2], block_n)], dim=-1).double()
    dod, vd = d_out.double(), v.double()
    den = p.sum(-1)
    size = (p * (dod.abs() @ vd.abs().transpose(-1, -2))).sum(-1) / den
    return (p * (dod @ vd.transpose(-1, -2))).sum(-1) / den, size


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_exact_delta_is_the_fp64_rowsum_of_its_own_p_times_dp(rounding, causal, seed):
    """The reference's exact pass equals FP64 rowsum(P * dP) / rowsum(P) within gamma(2n + D) T / rowsum(P) on
    every row; in fa2 it is much closer to the exact softmax's delta than fp32_output's (whose O32 has LP(P) in its
    numerator)."""
    q, k, v, d_out = tied_maxima_inputs(1, 2, 2, 130)
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix="exact_delta", causal=causal), BF16)
    out, lse, _ = forward_core(q, k, v, causal, nm, 64)
    delta = exact_delta(q, k, v, d_out, lse, causal, nm, 64)
    delta64, size = fp64_rowsum_p_dp(q, k, v, d_out, lse, causal, nm)
    n = 130
    err = (delta.double() - delta64).abs()
    assert (err <= gamma(2 * n + q.shape[-1]) * size).all(), f"seed={seed}: worst {(err / size).max().item():.2e}"
    if rounding == "paper":  # its P comes from bf16 scores: as far from the softmax's P as fp32_output's delta is
        return
    # fa2, against the exact softmax's delta rowsum(dO * O_exact) (FP64 P): the exact pass removes the O rounding
    o_exact = exact_attention(q, k, v, causal)[0]
    true = (d_out.double() * o_exact).sum(-1)
    nm32 = check_args(q, k, v, AttentionSettings(rounding=rounding, fix="fp32_output", causal=causal), BF16)
    _, _, o32 = forward_core(q, k, v, causal, nm32, 64)
    fp32_err = ((d_out.double() * o32.double()).sum(-1) - true).square().mean().sqrt()
    exact_err = (delta.double() - true).square().mean().sqrt()
    assert exact_err < fp32_err / 100, f"seed={seed}: exact {exact_err:.2e} vs fp32_output {fp32_err:.2e}"


def v_one_inputs(seq: int = 128, dim: int = 64):
    """Random q, k and dO, V = 1: the exact O is 1 and delta = rowsum(dO) on every row; dQ = dK = 0."""
    q, k, d_out = (torch.randn(1, 2, seq, dim).bfloat16() for _ in range(3))
    return q, k, torch.ones(1, 2, seq, dim, dtype=torch.bfloat16), d_out


# |O - 1| of each mode with V = 1 (one paper tile, T <= 512), from its rounding points: fa2 divides
# sum_j LP(P_j) (each within 2^-8 relative of P_j) by the FP32 sum_j P_j, a ratio in [1 - 2^-8, 1 + 2^-8] that the
# final RNE rounds to 1 - 2^-8 or 1 (the bf16 spacing is 2^-8 below 1, 2^-7 above); paper rounds the tile product
# and l to bf16 as well (ratio within 3 x 2^-8, then the final rounding's half spacing: 2^-6 in all);
# stochastic_output takes one of the two bf16 neighbours of the FP32 ratio (2^-7 above 1).
O_BOUND = {"fa2": 2.0**-8, "paper": 2.0**-6}


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_v_one_gives_each_mode_its_analytic_value(rounding, fix, seed):
    """V = 1: O within the mode's bound of 1 (O_BOUND); the backward's delta is rowsum(dO * O) for the modes whose
    delta uses an O (the FP32 O for fp32_output), so within that bound x sum_c |dO_c| of the exact rowsum(dO), and
    for exact_delta within gamma(2n + D) sum_c |dO_c| (the bound above with A_j = sum_c |dO_c|): about 2^-16 here,
    2^8 below a bf16 O's worst case. So exact_delta's dQ and dK are ~0, as the exact ones are (next test)."""
    q, k, v, d_out = v_one_inputs()
    keys = torch.tensor([seed], dtype=torch.int64)
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix), BF16, keys)
    out, lse, o32 = forward_core(q, k, v, True, nm, 64, noise_keys=keys)
    bound = O_BOUND[rounding] * (2 if fix == "stochastic_output" else 1)
    assert ((out.float() - 1).abs() <= bound).all(), f"seed={seed}"
    dof = d_out.float()
    g, size = dof.double().sum(-1), dof.double().abs().sum(-1)
    exact = exact_delta(q, k, v, d_out, lse, True, nm, 64) if nm.exact_pass else None
    o_used = o32 if fix == "fp32_output" else out
    delta = delta_of(dof, o_used, nm, o32, keys, exact=exact).double()
    if fix == "exact_delta":
        assert ((delta - g).abs() <= gamma(2 * q.shape[2] + q.shape[-1]) * size).all(), f"seed={seed}"
        return
    if fix == "fp32_output":
        assert ((o32 - 1).abs() <= O_BOUND["fa2"]).all(), "O32 = sum_j LP(P_j) / sum_j P_j (paper: its shadow)"
    slack = gamma(q.shape[-1]) * size  # the FP32 rowsum
    assert ((delta - (dof.double() * o_used.double()).sum(-1)).abs() <= slack).all(), f"seed={seed}"
    assert ((delta - g).abs() <= bound * size + slack).all(), f"seed={seed}"


def test_v_one_exact_delta_has_no_spurious_dq_dk_where_fp32_output_has(seed):
    """The exact softmax has dQ = dK = 0 when V = 1 (dS = P (dP - delta) = 0). fp32_output's delta differs from
    rowsum(dO) by (O32 - 1) rowsum(dO), and in fa2 O32 = sum LP(P) V / sum P is not 1: its dQ and dK are ~2^-9 of
    the scale of P dO; exact_delta's are 2^8 or more smaller."""
    q, k, v, d_out = v_one_inputs()
    grads = {}
    for fix in ("fp32_output", "exact_delta"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kernels.reference_attention(*leaves, True, "fa2", fix).backward(d_out)
        grads[fix] = [t.grad.double() for t in leaves]
    for name, i in (("dq", 0), ("dk", 1)):
        rms = {fix: g[i].square().mean().sqrt().item() for fix, g in grads.items()}
        assert 0 < rms["fp32_output"] and rms["exact_delta"] < 2.0**-8 * rms["fp32_output"], f"seed={seed}: {name}"
    assert same_bits(grads["fp32_output"][2], grads["exact_delta"][2]), "dV does not depend on delta"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_exact_reference_gain_formula(rounding, seed):
    """delta_reference=exact: gain 0 is exact_delta's delta (its gradients bit for bit, the forward being none's);
    gain g: delta_exact + g * s * (delta_mode - delta_exact), and exact_delta itself has no error at any gain."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    keys = torch.tensor([seed], dtype=torch.int64)

    def grads(**kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kernels.reference_attention(*leaves, True, rounding, noise_keys=keys, **kw).backward(d_out)
        return [t.grad for t in leaves]

    exact = grads(fix="exact_delta")
    for name, a, b in zip("qkv", grads(fix="none", delta_gain=0.0, delta_reference="exact"), exact):
        assert same_bits(a, b), f"seed={seed}: d{name} of gain 0 vs exact_delta"
    for name, a, b in zip("qkv", grads(fix="exact_delta", delta_gain=7.0, delta_sign="random",
                                       delta_reference="exact"), exact):
        assert same_bits(a, b), f"seed={seed}: d{name}: exact_delta has no error to amplify"
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, delta_gain=5.0, delta_sign="random",
                                               delta_reference="exact"), BF16, keys)
    assert nm.exact_pass and not nm.keeps_fp32_output  # the exact pass replaces the FP32 O
    kk, vv = _expand_kv(k, 4), _expand_kv(v, 4)
    out, lse, o32 = forward_core(q, kk, vv, True, nm, 64, noise_keys=keys)
    assert o32 is None
    dof = d_out.float()
    d_exact = exact_delta(q, kk, vv, d_out, lse, True, nm, 64)
    signs = kernels.rounding.delta_signs(d_exact.shape, keys, 0, d_exact.device)
    expected = d_exact + (5.0 * signs) * ((dof * out.float()).sum(-1) - d_exact)
    assert same_bits(delta_of(dof, out, nm, None, keys, exact=d_exact), expected)


def test_saved_output_of_exact_delta_gives_its_delta(seed):
    """saved_output for exact_delta is P V (FP32) with the backward's P: rowsum(dO * it) is the exact pass's delta up
    to the order of the FP32 sums (the delta-bias monitor's delta_lp for this fix)."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    saved = kernels.saved_output(q, k, v, fix="exact_delta")
    assert saved.dtype == torch.float32
    nm = check_args(q, k, v, AttentionSettings(fix="exact_delta"), BF16)
    kk, vv = _expand_kv(k, 4), _expand_kv(v, 4)
    _, lse, _ = forward_core(q, kk, vv, True, nm, 64)
    d_exact = exact_delta(q, kk, vv, d_out, lse, True, nm, 64).double()
    via_o = (d_out.double() * saved.double()).sum(-1)
    size = (d_out.double().abs() * saved.double().abs()).sum(-1)
    assert ((via_o - d_exact).abs() <= gamma(80 + 32) * size + 1e-30).all(), f"seed={seed}"
    assert reference.exact_output(q, kk, vv, lse, True, nm, 64).shape == q.shape
