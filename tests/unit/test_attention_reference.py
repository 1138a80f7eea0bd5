"""The PyTorch reference attention: rounding helpers, accuracy of every mode, the fixes' safety, the tie bias.

Inputs are fresh random draws each run; the seed is printed (shown by pytest on failure) and named in messages.
"""

from __future__ import annotations


import pytest
import torch

import kernels
from kernels import reference
from kernels.tie_bias import CASES, EXACT, Mode, build_inputs, measure_cases
from kernels.modes import AttentionSettings, check_args, mode_kwargs
from kernels.rounding import SHIFT_LO, rne_bf16, round_lp, safe_shift
from tests.attention_common import (MODES, NAN, assert_head_slices_match_whole, fp64_out_and_grads, nan_filled,
                                    out_and_grads, rel_err, same_bits, tied_maxima_inputs)

# Every call here starts the backward's tile-filled gradient buffers NaN-filled, so a tile it misses shows up.
reference_attention = nan_filled(kernels.reference_attention)


# --------------------------------------------------------------------------------------------------------------
# Rounding helpers
# --------------------------------------------------------------------------------------------------------------


def test_rne_bf16_matches_torch_cast_bit_for_bit(seed):
    x = torch.cat([
        torch.randn(100_000) * torch.exp2(torch.randint(-130, 120, (100_000,)).float()),
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895314e38, -3.3895314e38, 3.40282e38, 1e-45,
                      -1e-45, 1.17549435e-38]),
        # exact ties between two bf16 neighbours, both parities of the kept bit
        (torch.randint(-(2**15), 2**15, (1000,), dtype=torch.int32) * 65536 + 0x8000).view(torch.float32),
    ])
    x = x[torch.isfinite(x) | torch.isinf(x)]
    ours = rne_bf16(x).view(torch.int32)
    torchs = x.to(torch.bfloat16).to(torch.float32).view(torch.int32)
    assert torch.equal(ours, torchs), f"seed={seed}"
    assert torch.isnan(rne_bf16(torch.tensor([float("nan")]))).all()


def test_round_lp_fp16_is_the_cast(seed):
    x = torch.randn(10_000) * 100
    assert torch.equal(round_lp(x, torch.float16), x.half().float())
    assert torch.equal(round_lp(x, torch.float32), x)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_pow2_scale_keeps_bf16_scores_exact(head_dim):
    """The kernel's shortcut for rounding=paper (``Numerics.score_rounds_once``): with a power-of-two scale, every
    bf16 value times the scale is a bf16 value again (S's second rounding a no-op) from FP32's smallest normal up,
    and the shortcut is taken exactly for bf16 at head_dim 16 and 64. Below 2^-126 it is not exact (checked too, so
    that the documented boundary is the real one)."""
    scale = head_dim**-0.5
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    scaled = every_bf16[torch.isfinite(every_bf16)] * scale
    normal = (scaled.abs() >= 2.0**-126) | (scaled == 0)
    assert torch.equal(round_lp(scaled[normal], torch.bfloat16), scaled[normal])
    assert not torch.equal(round_lp(scaled[~normal], torch.bfloat16), scaled[~normal])
    x = torch.zeros(1, 1, 4, head_dim, dtype=torch.bfloat16)
    assert check_args(x, x, x, AttentionSettings(rounding="paper"), (torch.bfloat16,)).score_rounds_once
    assert not check_args(x, x, x, AttentionSettings(rounding="fa2"), (torch.bfloat16,)).score_rounds_once
    assert not check_args(x.half(), x.half(), x.half(), AttentionSettings(rounding="paper"), (torch.float16,)).score_rounds_once
    for other in (32, 128):
        y = torch.zeros(1, 1, 4, other, dtype=torch.bfloat16)
        assert not check_args(y, y, y, AttentionSettings(rounding="paper"), (torch.bfloat16,)).score_rounds_once


def test_safe_shift_is_bounded_and_varies_per_row(seed):
    rows = torch.arange(4096)
    for value in (0.0, -0.0, 1.0, -3.5, 1e4, 1e30, float("-inf")):
        delta = safe_shift(torch.full((4096,), value), rows, torch.zeros(4096, dtype=torch.long))
        assert delta.min() >= SHIFT_LO and delta.max() < SHIFT_LO + 0.5
        assert delta.unique().numel() > 3000, "the same maximum in every row must still give varied shifts"
        # the largest shifted P_bar rounds below 1 in bf16 in both exponent units
        assert (rne_bf16(torch.exp2(-delta)) < 1).all() and (rne_bf16(torch.exp(-delta)) < 1).all()
    zero = safe_shift(torch.tensor([0.0]), torch.tensor([5]), torch.tensor([3]))
    assert torch.equal(zero, safe_shift(torch.tensor([-0.0]), torch.tensor([5]), torch.tensor([3])))


# --------------------------------------------------------------------------------------------------------------
# Accuracy of every mode against fp64 (outputs and gradients)
# --------------------------------------------------------------------------------------------------------------

# relative-norm tolerances: bf16 operands land at a few 1e-3 (paper rounding about twice fa2); fp16 8x tighter
TOL = {torch.bfloat16: {"fa2": 6e-3, "paper": 1.2e-2}, torch.float16: {"fa2": 8e-4, "paper": 1.5e-3}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_reference_matches_fp64(rounding, fix, causal, dtype, seed):
    if fix == "stochastic_output" and dtype == torch.float16:
        pytest.skip("stochastic_output is bf16 only (fp16 inputs are refused: see test_stochastic_output_refuses_fp16)")
    seq = int(torch.randint(65, 200, (1,)))  # ragged: never a multiple of the 64-key tile
    q, k, v = (torch.randn(2, 4, seq, 64).to(dtype).requires_grad_() for _ in range(3))
    d_out = torch.randn(2, 4, seq, 64).to(dtype)
    out = reference_attention(q, k, v, causal, rounding, fix)
    out.backward(d_out)
    ref_out, ref_grads = fp64_out_and_grads(q, k, v, d_out, causal)
    tol = TOL[dtype][rounding]
    msg = f"seed={seed} seq={seq}"
    assert out.dtype == dtype
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v)), msg
    assert rel_err(out, ref_out) < tol, msg
    for name, t, g in zip("qkv", (q, k, v), ref_grads):
        assert rel_err(t.grad, g) < 2 * tol, f"d{name} {msg}"


@pytest.mark.parametrize("head_dim", [32, 128])
def test_reference_head_dims_and_gqa(head_dim, seed):
    q = torch.randn(1, 4, 97, head_dim).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 97, head_dim).bfloat16().requires_grad_() for _ in range(2))
    d_out = torch.randn(1, 4, 97, head_dim).bfloat16()
    for rounding, fix in (("fa2", "none"), ("paper", "dynamic_max")):
        for t in (q, k, v):
            t.grad = None
        out = reference_attention(q, k, v, True, rounding, fix)
        out.backward(d_out)
        ref_out, ref_grads = fp64_out_and_grads(q, k, v, d_out, True)
        assert k.grad.shape == k.shape
        assert rel_err(out, ref_out) < 1.2e-2, f"seed={seed}"
        for t, g in zip((q, k, v), ref_grads):
            assert rel_err(t.grad, g) < 2.4e-2, f"seed={seed}"


def test_fp32_inputs_emulate_bf16_autocast(seed):
    q, k, v = (torch.randn(2, 2, 70, 64, requires_grad=True) for _ in range(3))
    out = reference_attention(q, k, v, True, "paper", "dynamic_max")
    assert out.dtype == torch.float32
    assert torch.equal(out, out.bfloat16().float()), "O must be bf16-representable"
    as_bf16 = reference_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), True, "paper", "dynamic_max")
    assert torch.equal(out, as_bf16.float())
    out.sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def test_block_m_changes_no_bit(seed):
    q, k, v = (torch.randn(1, 2, 150, 64).bfloat16() for _ in range(3))
    a = reference_attention(q, k, v, True, "paper", "dynamic_max", block_m=64)
    b = reference_attention(q, k, v, True, "paper", "dynamic_max", block_m=128)
    assert torch.equal(a, b)


def test_out_fill_changes_no_bit(seed):
    """The NaN fill these tests run with reaches the tile-filled dk, dv and changes nothing where every tile is
    written (GQA: the expanded heads are summed after the fill)."""
    q, d_out = torch.randn(1, 4, 150, 64).bfloat16(), torch.randn(1, 4, 150, 64).bfloat16()
    k, v = (torch.randn(1, 2, 150, 64).bfloat16() for _ in range(2))
    results = []
    for fill in (None, NAN):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kernels.reference_attention(*leaves, True, "fa2", "dynamic_max", out_fill=fill).backward(d_out)
        results.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*results)), f"seed={seed}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_saved_output_is_what_delta_uses(rounding, seed):
    q, k, v = (torch.randn(1, 2, 90, 64).bfloat16() for _ in range(3))
    out = reference_attention(q, k, v, True, rounding, "none")
    assert torch.equal(kernels.saved_output(q, k, v, rounding=rounding), out)
    o32 = kernels.saved_output(q, k, v, rounding=rounding, fix="fp32_output")
    assert o32.dtype == torch.float32
    exact = fp64_out_and_grads(q, k, v, None, True)[0]
    assert rel_err(o32, exact) < rel_err(out, exact), "the fp32 O must be closer to exact than the bf16 O"
    with pytest.raises(ValueError, match="backend"):
        kernels.saved_output(q, k, v, backend="cuda")


def test_bad_arguments_give_clear_errors():
    q = torch.randn(1, 2, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="rounding"):
        reference_attention(q, q, q, rounding="bf16")
    with pytest.raises(ValueError, match="fix"):
        reference_attention(q, q, q, fix="stable")
    with pytest.raises(ValueError, match="head_dim"):
        reference_attention(*(torch.randn(1, 2, 8, 48).bfloat16(),) * 3)
    with pytest.raises(ValueError, match="divisible"):
        reference_attention(torch.randn(1, 3, 8, 64).bfloat16(), q, q)
    with pytest.raises(ValueError, match="block_n"):
        reference_attention(q, q, q, block_n=48)
    with pytest.raises(TypeError, match="dtype"):
        reference_attention(q.double(), q.double(), q.double())


# --------------------------------------------------------------------------------------------------------------
# Global head index (tensor parallelism: each rank sees a slice of the heads)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_head_slices_with_global_index_match_the_whole_call(rounding, causal, seed):
    """dynamic_max hashes the global head index: two head slices (as two tensor-parallel ranks see them) with
    head_offset / total_heads give the bits of one call on all heads, in O and in dq, dk, dv (GQA: 2 q heads per
    k/v head, so each slice keeps whole groups); without the offset the last slice differs."""
    seq = int(torch.randint(65, 200, (1,)))
    q, k, v, d_out = tied_maxima_inputs(2, 4, 2, seq)
    assert_head_slices_match_whole(reference_attention, q, k, v, d_out, msg=f"seed={seed} seq={seq}",
                                   causal=causal, rounding=rounding, fix="dynamic_max")


def test_head_slices_in_four_and_saved_output(seed):
    """Four one-head slices (tensor-parallel degree 4) and saved_output with the global index."""
    seq = int(torch.randint(65, 140, (1,)))
    q, k, v, d_out = tied_maxima_inputs(2, 4, 4, seq)
    kw = dict(rounding="paper", fix="dynamic_max")
    slices = assert_head_slices_match_whole(reference_attention, q, k, v, d_out, parts=4,
                                            msg=f"seed={seed} seq={seq}", **kw)
    saved = kernels.saved_output(q[:, 3:], k[:, 3:], v[:, 3:], head_offset=3, total_heads=4, **kw)
    assert torch.equal(saved, slices[3]), f"seed={seed}"
    assert torch.equal(kernels.saved_output(q, k, v, **kw)[:, 3:], saved), f"seed={seed}"


def test_build_attention_passes_the_global_head_index(seed):
    from model.attention import AttentionConfig, build_attention

    q, k, v, _ = tied_maxima_inputs(2, 4, 4, 80)
    config = AttentionConfig(backend="reference", rounding="fa2", fix="dynamic_max")
    local = build_attention(config, torch.device("cpu"), head_offset=2, total_heads=4)
    whole = build_attention(config, torch.device("cpu"))
    assert torch.equal(local(q[:, 2:], k[:, 2:], v[:, 2:]), whole(q, k, v)[:, 2:]), f"seed={seed}"
    assert not torch.equal(whole(q[:, 2:], k[:, 2:], v[:, 2:]), whole(q, k, v)[:, 2:]), f"seed={seed}"
    with pytest.raises(ValueError, match="total_heads"):
        build_attention(config, torch.device("cpu"), head_offset=3, total_heads=4)(q[:, 2:], k[:, 2:], v[:, 2:])
    sdpa = build_attention(AttentionConfig(backend="sdpa"), torch.device("cpu"), head_offset=2, total_heads=4)
    assert sdpa(q[:, 2:], k[:, 2:], v[:, 2:]).shape == q[:, 2:].shape  # ignored: no head-dependent numerics


def test_build_attention_gives_the_triton_kernel_its_launch_options(seed):
    """attention.autotune and attention.deterministic reach the kernels' settings of the attention callable (the
    object that goes to the implementation), and only the compiled kernels use them: the reference, which has no
    launches, gives the same bits with either value. Nothing is launched on a GPU here."""
    from model.attention import AttentionConfig, build_attention

    cpu = torch.device("cpu")
    triton_call = build_attention(AttentionConfig(backend="triton", autotune=False, deterministic=False), cpu)
    assert triton_call.settings.autotune is False and triton_call.settings.deterministic is False
    assert build_attention(AttentionConfig(backend="triton"), cpu).settings.deterministic is True
    q, k, v, d_out = tied_maxima_inputs(1, 2, 2, 70)
    results = []
    for autotune, deterministic in ((True, True), (False, False)):
        call = build_attention(AttentionConfig(backend="reference", autotune=autotune, deterministic=deterministic),
                               cpu)
        results.append(out_and_grads(call, q, k, v, d_out))
    (o_a, grads_a), (o_b, grads_b) = results
    assert same_bits(o_a, o_b) and all(same_bits(a, b) for a, b in zip(grads_a, grads_b)), f"seed={seed}"


def test_defaults_are_the_unsharded_head_index(seed):
    """head_offset=0, total_heads=0 and total_heads=q heads are the same call (existing callers unchanged)."""
    q, k, v, _ = tied_maxima_inputs(2, 2, 2, 70)
    plain = reference_attention(q, k, v, rounding="paper", fix="dynamic_max")
    explicit = reference_attention(q, k, v, rounding="paper", fix="dynamic_max", head_offset=0,
                                           total_heads=2)
    assert torch.equal(plain, explicit), f"seed={seed}"


def test_bad_head_index_gives_clear_errors():
    q = torch.randn(1, 2, 8, 64).bfloat16()
    with pytest.raises(ValueError, match="head_offset=-1 must be >= 0"):
        reference_attention(q, q, q, head_offset=-1, total_heads=4)
    with pytest.raises(ValueError, match="total_heads=-4 must be >= 0"):
        reference_attention(q, q, q, total_heads=-4)
    with pytest.raises(ValueError, match="exceeds total_heads=4"):
        reference_attention(q, q, q, head_offset=3, total_heads=4)
    with pytest.raises(ValueError, match="exceeds total_heads=1"):
        reference_attention(q, q, q, total_heads=1)
    with pytest.raises(ValueError, match="needs total_heads"):
        reference_attention(q, q, q, head_offset=2)
    with pytest.raises(TypeError, match="must be an int"):
        reference_attention(q, q, q, head_offset=1.0, total_heads=4)
    with pytest.raises(ValueError, match="head_offset"):
        kernels.saved_output(q, q, q, head_offset=-1, total_heads=4)
    nm = check_args(q, q, q, AttentionSettings(fix="dynamic_max"), (torch.bfloat16,))
    with pytest.raises(ValueError, match="exceeds total_heads"):
        reference.forward_core(q, q, q, True, nm, 64, head_offset=1, total_heads=2)


# --------------------------------------------------------------------------------------------------------------
# Safety of the fixes
# --------------------------------------------------------------------------------------------------------------


def tied_inputs(logit: float, ties: int, dtype=torch.bfloat16, seq: int = 130, dim: int = 64, spread=False):
    """Every row's maximum logit is attained by ``ties`` keys (adjacent, or spread over tiles); the others are lower.

    V is all ones, so a correct row of O is 1 (within the rounding of the shifted P_bar) and a zeroed or NaN row is
    unmistakable.
    """
    q = torch.zeros(1, 2, seq, dim)
    k = torch.zeros(1, 2, seq, dim)
    scale = dim**0.5
    q[..., 0] = 1.0
    k[..., 0] = (logit - abs(logit) / 4 - 1) * scale  # every other key well below the maximum
    pos = torch.linspace(0, seq - 1, ties).long() if spread else torch.arange(ties) + 3 * (ties < seq - 3)
    k[:, :, pos, 0] = logit * scale
    return q.to(dtype), k.to(dtype), torch.ones(1, 2, seq, dim, dtype=dtype)


SAFETY_CASES = [(0.0, 2), (0.0, 130), (1.0, 2), (50.0, 3), (120.0, 2), (1e4, 4), (1e30, 2), (-120.0, 2), (-1e4, 3)]


@pytest.mark.parametrize("spread", [False, True], ids=["one-tile", "spread"])
@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
@pytest.mark.parametrize("logit,ties", SAFETY_CASES)
def test_safe_fix_never_nan_inf_or_zeroed(rounding, logit, ties, spread):
    q, k, v = tied_inputs(logit, ties, spread=spread)
    out = reference_attention(q, k, v, False, rounding, "dynamic_max")
    assert torch.isfinite(out).all()
    assert ((out.float() - 1).abs() <= 2**-6).all(), "every row of O must be 1 (V is all ones), none zeroed"


def test_safe_fix_fully_masked_rows_are_zero_not_nan():
    q, k, v = (torch.randn(1, 2, 70, 64).bfloat16() for _ in range(3))
    for rounding in kernels.ROUNDINGS:
        nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix="dynamic_max"), (torch.bfloat16,))
        out, lse, _ = reference.forward_core(q, k, v, False, nm, 64, kv_len=0)
        assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_published_rule_underflows_to_zeroed_rows(rounding):
    """The paper's rule as the authors run it: a repeated logit of 120 with beta 2 (or 20 with beta 7, or -120)
    underflows every P_bar; the row sum clamp at 1e-10 turns the 0/0 into silently zeroed rows (V is all ones, so
    a correct row is 1), with finite gradients. The safe fix keeps the rows."""
    for logit, beta in ((120.0, 2.0), (20.0, 7.0), (-120.0, 2.0)):
        q, k, v = (t.requires_grad_() for t in tied_inputs(logit, 2))
        out = reference_attention(q, k, v, False, rounding, "dynamic_max_published", beta=beta)
        assert (out == 0).all(), f"logit={logit} beta={beta}: the published rule should zero the rows here"
        out.float().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        safe = reference_attention(q, k, v, False, rounding, "dynamic_max", beta=beta)
        assert ((safe.float() - 1).abs() <= 2**-6).all()


# --------------------------------------------------------------------------------------------------------------
# Tie bias on the reference
# --------------------------------------------------------------------------------------------------------------


def test_tie_bias_reference(seed):
    modes = [Mode("paper", "none"), Mode("paper", "dynamic_max"), Mode("paper", "fp32_output"), Mode("fa2", "none"),
             Mode("fa2", "dynamic_max")]
    _, by_case = measure_cases("reference", sequences=16, seed=seed, modes=modes, cases=["tile"])
    res = by_case["tile"]
    paper_none = res["paper/none"]["o_imb"]
    assert -0.32 < paper_none[2] < -0.18, f"seed={seed}: paper/none k=2 should be near -1/4 ulp: {paper_none}"
    assert paper_none[3] < -0.08 and paper_none[4] < -0.06
    # The tile case's 256 keys are one paper tile (512 keys by default): l = bf16(1 + eps) rounds the other keys' weight
    # eps (~2e-3 < 2^-8) away while O keeps it, so rows without ties are too large in magnitude by ~eps, -0.2 ulp.
    assert -0.35 < paper_none[1] < -0.1, f"seed={seed}: the rounding of l in a whole-row tile: {paper_none}"
    assert res["paper/dynamic_max"]["o_imb"][1] == paper_none[1], "the fix leaves rows without ties alone"
    assert res["paper/none"]["delta"][2] > 0.18, "the delta error must be positive where dO shares V's sign"
    for key in ("o_imb", "o_ctl", "delta"):
        vals = res["fa2/dynamic_max"][key]
        assert all(abs(x) < 0.05 for x in vals.values()), f"seed={seed} fa2/dynamic_max {key}: {vals}"
    for key in ("o_imb", "delta"):  # paper rounding: the tie bias is gone (rows with ties; k=1: see above)
        vals = res["paper/dynamic_max"][key]
        assert all(abs(vals[k]) < 0.13 for k in (2, 3, 4)), f"seed={seed} paper/dynamic_max {key}: {vals}"
    assert all(abs(x) < 0.05 for x in res["paper/fp32_output"]["delta"].values())
    assert all(r["nan_rows"] == 0 and r["zero_rows"] == 0 for r in res.values())


def test_fa2_tie_bias_across_tiles_and_its_fix(seed):
    """Sink-like V, ties spread over 1024 keys: fa2/none rounds the even-k midpoints toward 0 like a correctly
    rounded O (+1/4, +1/8 ulp at k = 2, 4); the safe fix, which also triggers on ties across tiles, removes it."""
    modes = [Mode("fa2", "none"), Mode("fa2", "dynamic_max"), EXACT]
    _, by_case = measure_cases("reference", sequences=16, seed=seed, modes=modes, cases=["sink"])
    res = by_case["sink"]
    none, exact, fixed = (res[m]["o_imb"] for m in ("fa2/none", EXACT, "fa2/dynamic_max"))
    assert 0.18 < none[2] < 0.3 and 0.08 < none[4] < 0.17 and abs(none[3]) < 0.03, f"seed={seed}: {none}"
    assert all(abs(none[t] - exact[t]) < 0.01 for t in (2, 3, 4)), f"seed={seed}: fa2 is bf16(exact) here"
    assert all(abs(fixed[t]) < 0.03 for t in (2, 3, 4)), f"seed={seed} fa2/dynamic_max: {fixed}"
    assert all(abs(res["fa2/dynamic_max"]["delta"][t]) < 0.03 for t in (2, 3, 4)), f"seed={seed}"


def test_tie_bias_cases_place_ties_as_named(seed):
    """Every row's maximum is attained exactly k times; inside one 64-key tile for tile/dominant, across tiles for
    most rows of spread/sink."""
    gen = torch.Generator().manual_seed(seed)
    for name, case in CASES.items():
        q, k, _, _, row_ties = build_inputs(1, gen, case)
        assert q.shape == (1, 1, case.seq, 64) and set(row_ties.unique().tolist()) == set(case.tie_counts)
        scores = (q.float() @ k.float().transpose(-1, -2))[0, 0]
        tied = scores == scores.amax(-1, keepdim=True)
        assert torch.equal(tied.sum(-1), row_ties[0]), f"seed={seed} {name}"
        tiles_hit = (tied.view(case.seq, -1, 64).any(-1)).sum(-1)
        one_tile = (tiles_hit == 1)[row_ties[0] > 1]
        assert one_tile.all() if not case.spread else one_tile.float().mean() < 0.5, f"seed={seed} {name}"


def test_mode_kwargs_forwards_the_paper_tile_only_when_given():
    assert mode_kwargs("paper", "none") == {"rounding": "paper", "fix": "none"}
    assert mode_kwargs("paper", "none", 0) == {"rounding": "paper", "fix": "none", "paper_block_keys": 0}
    assert Mode("paper", "dynamic_max", 0).label == "paper@row/dynamic_max"
    assert Mode("paper", "none", 512).label == "paper@512/none" and Mode("fa2", "none").label == "fa2/none"


@pytest.mark.parametrize("rounding", ["fa2", "paper"])
def test_reference_is_unaffected_by_an_enclosing_autocast(rounding):
    """The model calls the reference inside CPU BF16 autocast when precision.dtype=bf16."""
    q, k, v = (torch.randn(1, 2, 80, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    plain = reference_attention(q, k, v, rounding=rounding)
    grads = torch.autograd.grad(plain.float().sum(), (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = reference_attention(q, k, v, rounding=rounding)
        grads_under = torch.autograd.grad(under.float().sum(), (q, k, v))
    assert torch.equal(plain, under)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_under))
