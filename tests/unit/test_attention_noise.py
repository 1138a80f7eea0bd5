"""Noise keys, the delta-error stress (delta_gain / delta_sign) and fix=stochastic_output in the PyTorch reference.

The Triton kernel's copies of the same hashes and paths are checked in test_attention_triton_interp.py (interpreter)
and tests/gpu/test_attention_gpu.py. Inputs are fresh random draws each run (``seed`` fixture).
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import reference
from kernels.modes import AttentionSettings, check_args
from kernels.reference import _expand_kv, delta_of, forward_core
from kernels.rounding import (OUTPUT_SIGN_SALT, _mix32_int, delta_signs, layer_keys, mix32, noise_row_hash,
                              round_lp, row_keys, sr_bf16, sr_bits, stochastic_bf16)
from tests.attention_common import (NAN, MODES, assert_head_slices_match_whole, nan_filled, same_bits,
                                    tied_maxima_inputs)

BF16 = (torch.bfloat16, torch.float16, torch.float32)


# Every call here starts the backward's tile-filled gradient buffers NaN-filled, so a tile it misses shows up.
reference_attention = nan_filled(kernels.reference_attention)


def out_and_grads(q, k, v, d_out, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, *args, **kwargs)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def inputs(batch=2, heads=4, kv_heads=2, seq=90, dim=32):
    q = torch.randn(batch, heads, seq, dim).bfloat16()
    k, v = (torch.randn(batch, kv_heads, seq, dim).bfloat16() for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, dim).bfloat16()


def keys_for(batch, seed=0, step=0, layer=1, first_row=0):
    return layer_keys(row_keys(seed, step, torch.arange(first_row, first_row + batch)), layer)


# --------------------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------------------


def test_mix32_is_the_kernel_finaliser_and_matches_its_scalar_copy(seed):
    x = torch.randint(0, 2**32, (1000,), dtype=torch.int64)
    out = mix32(x)
    assert out.dtype == torch.int64 and int(out.min()) >= 0 and int(out.max()) < 2**32
    assert [_mix32_int(int(a)) for a in x[:50]] == out[:50].tolist()
    assert len(set(out.tolist())) == len(set(x.tolist())), "mix32 is a bijection of 32-bit values"


def test_row_and_layer_keys_are_reproducible_distinct_and_32_bit(seed):
    rows = torch.arange(256)
    a = row_keys(seed, 7, rows)
    assert torch.equal(a, row_keys(seed, 7, rows)) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 2**32
    assert torch.equal(row_keys(seed, 7, rows.int()), a), "int32 rows give the same keys"
    assert torch.equal(row_keys(seed, 7, rows[100:120]), a[100:120]), "a row's key does not depend on the others"
    for other in (row_keys(seed, 8, rows), row_keys(seed + 1, 7, rows), row_keys(seed + 2**32, 7, rows),
                  row_keys(seed, 7 + 2**32, rows), layer_keys(a, 0), layer_keys(a, 1)):
        assert (other != a).float().mean() > 0.99
    assert len(set(a.tolist())) == len(rows)
    assert (layer_keys(a, 0) != layer_keys(a, 1)).all()
    with pytest.raises(TypeError, match="seed"):
        row_keys(1.5, 0, rows)
    with pytest.raises(TypeError, match="layer"):
        layer_keys(a, -1)


def test_layer_keys_compile(seed):
    keys = row_keys(seed, 3, torch.arange(8))
    compiled = torch.compile(lambda r: layer_keys(r, 5), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(keys), layer_keys(keys, 5))


# --------------------------------------------------------------------------------------------------------------
# Stochastic rounding
# --------------------------------------------------------------------------------------------------------------


def bf16_neighbours(x: torch.Tensor):
    """The bf16 values just below and above |x| in magnitude (toward zero, away from zero), with x's sign."""
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = ((down.view(torch.int32).to(torch.int64) + 65536) & 0xFFFFFFFF)
    up = torch.where(up >= 2**31, up - 2**32, up).to(torch.int32).view(torch.float32)
    return down, up


def test_sr_values_are_bf16_neighbours_never_nan_and_keep_exact_values(seed):
    x = torch.cat([torch.randn(20_000) * torch.exp2(torch.randint(-140, 120, (20_000,)).float()),
                   torch.tensor([0.0, -0.0, 3.3895314e38, -3.3895314e38, 3.4028235e38, 1e-45, -1e-45, 1.1754942e-38])])
    x = x[torch.isfinite(x)]
    bits = torch.randint(0, 2**16, x.shape)
    y = sr_bf16(x, bits)
    assert not torch.isnan(y).any()
    assert torch.equal(y, y.bfloat16().float()), "SR values are bf16 values"
    down, up = bf16_neighbours(x)
    assert ((y.view(torch.int32) == down.view(torch.int32)) | (y.view(torch.int32) == up.view(torch.int32))).all()
    exact = x.bfloat16().float()
    assert same_bits(sr_bf16(exact, bits), exact), "bf16 values (zeros of both signs included) stay unchanged"
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out = sr_bf16(special, torch.full((3,), 0xFFFF))
    assert torch.isnan(out[0]) and out[1] == float("inf") and out[2] == -float("inf")
    assert torch.equal(sr_bf16(x, bits), y), "same bits, same result"


def test_sr_bits_rows_of_zeros_key_are_not_degenerate():
    """noise_keys=None means key 0 for every row: the hash must still spread (mix32 has a fixed point at 0)."""
    rh = noise_row_hash(torch.zeros(1, 1, 1, dtype=torch.int64), torch.arange(4).view(1, 4, 1),
                        torch.arange(64).view(1, 1, 64))
    bits = sr_bits(rh.unsqueeze(-1), torch.arange(64))
    n, m = bits.numel(), 2**16
    assert len(set(bits.flatten().tolist())) > 0.97 * m * (1 - math.exp(-n / m)), "distinct values of n uniform draws"
    assert abs(bits.double().mean().item() / 65536 - 0.5) < 0.02


def test_sr_mean_error_vanishes_over_keys_while_rne_is_biased(seed):
    """Unbiasedness of stochastic_output's rounding over draws of the noise key.

    Values: the paper's worked example (-2.40625 + -2.296875 = -4.703125 with an FP32 residual of -0.00087: RNE
    rounds it to -4.71875, an error of -0.0147 = -0.47 ulp every time) and random FP32 values. Each of N = 4096
    batch rows gets its own key (row_keys of global rows 0..N-1), so every element is rounded N times with N
    independent-looking 16-bit draws. For one element whose dropped 16 bits are L, SR rounds away from zero with
    probability f = L / 2^16 (exact for uniform bits), so its error in ulps is 1 - f or -f: mean 0, variance
    f(1 - f) <= 1/4. The mean over N draws then has standard error se = sqrt(f(1 - f) / N) (f exact per element),
    and |mean| < 5 se has a false-alarm probability of ~6e-7 per element under the ideal generator (normal
    approximation; N f(1 - f) >> 1 for the values used). Pooled over all E elements, the grand mean has
    se = sqrt(N sum f(1 - f)) / (N E), also tested at 5 se. RNE's error on the worked example is deterministic and
    must exceed 20 se of SR's (it is ~60).
    """
    n = 4096
    worked = torch.tensor([-4.703125 - 0.00087])
    # random values whose dropped 16 bits are between 5% and 95% of an ulp (so N f (1 - f) >> 1)
    base = (torch.randn(31) * 3).view(torch.int32) & -65536
    low = torch.randint(int(0.05 * 65536), int(0.95 * 65536), (31,), dtype=torch.int32)
    values = torch.cat([worked, (base + low).view(torch.float32)]).view(1, 1, 32, 1).expand(1, 1, 32, 2).contiguous()
    x = values.expand(n, -1, -1, -1).contiguous()
    keys = layer_keys(row_keys(seed, 0, torch.arange(n)), 0)
    y = stochastic_bf16(x, keys).double()
    down, up = bf16_neighbours(values.float())
    ulp = (up.double() - down.double()).abs()
    f = ((values.double() - down.double()).abs() / ulp)  # dropped fraction, exact
    err = (y - values.double()) / ulp  # error in ulps per draw
    mean = err.mean(0)
    se = (f * (1 - f) / n).sqrt()
    assert (f > 0.01).all() and (f < 0.99).all(), "the values must need rounding"
    assert (mean.abs() < 5 * se).all(), f"seed={seed}: worst |mean|/se = {(mean.abs() / se).max().item():.2f}"
    grand_se = (n * (f * (1 - f)).sum()).sqrt() / (n * f.numel())
    assert abs(err.mean().item()) < 5 * grand_se.item(), f"seed={seed}"
    rne = (worked.bfloat16().double() - worked.double()) / ulp.flatten()[0]
    assert rne.item() < -0.4 and abs(rne.item()) > 20 * se.flatten()[0].item(), "RNE is biased on this value"
    assert worked.bfloat16().item() == -4.71875


# --------------------------------------------------------------------------------------------------------------
# fix=stochastic_output in the attention
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_stochastic_output_is_sr_of_the_fp32_output(rounding, seed):
    """O = SR_bf16(O_fp32) with O_fp32 what fp32_output keeps (paper: its FP32 shadow); same key, same bits; other
    keys, other bits; the backward's delta uses the SR'd O (saved_output)."""
    q, k, v, d_out = inputs()
    keys = keys_for(2, seed)
    out = reference_attention(q, k, v, True, rounding, "stochastic_output", noise_keys=keys)
    o32 = kernels.saved_output(q, k, v, rounding=rounding, fix="fp32_output")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert same_bits(out.float(), stochastic_bf16(o32, keys))
    assert same_bits(out, reference_attention(q, k, v, True, rounding, "stochastic_output", noise_keys=keys))
    other = reference_attention(q, k, v, True, rounding, "stochastic_output", noise_keys=keys + 1)
    assert 0.1 < (other != out).float().mean() < 0.9
    assert same_bits(kernels.saved_output(q, k, v, rounding=rounding, fix="stochastic_output", noise_keys=keys), out)
    down, up = bf16_neighbours(o32)
    assert ((out.float() == down) | (out.float() == up)).all()
    none = reference_attention(q, k, v, True, rounding, "stochastic_output")
    assert same_bits(none, reference_attention(q, k, v, True, rounding, "stochastic_output",
                                                       noise_keys=torch.zeros(2, dtype=torch.int64)))


def test_stochastic_output_gradients_are_the_flash_backward_of_its_o(seed):
    """Its backward is fix=none's with delta from the SR'd O: equal to the amplified path at gain 1 up to rounding,
    and its LSE (hence P) is none's."""
    q, k, v, d_out = inputs()
    keys = keys_for(2, seed)
    nm = check_args(q, k, v, AttentionSettings(fix="stochastic_output"), BF16)
    nm_none = check_args(q, k, v, AttentionSettings(), BF16)
    kk, vv = _expand_kv(k, 4), _expand_kv(v, 4)
    out, lse, _ = forward_core(q, kk, vv, True, nm, 64, noise_keys=keys)
    _, lse_none, _ = forward_core(q, kk, vv, True, nm_none, 64)
    assert same_bits(lse, lse_none)
    dq, dk, dv = reference.backward_core(q, kk, vv, out, lse, d_out, True, nm, 64, out_fill=NAN)
    ref_out, ref_grads = out_and_grads(q, k, v, d_out, True, "fa2", "stochastic_output", noise_keys=keys)
    assert same_bits(ref_out, out)
    assert same_bits(ref_grads[0], dq.bfloat16())


def test_stochastic_output_refuses_fp16_and_bad_keys():
    q = torch.randn(2, 2, 16, 32)
    with pytest.raises(ValueError, match="use bf16"):
        reference_attention(q.half(), q.half(), q.half(), fix="stochastic_output")
    qb = q.bfloat16()
    with pytest.raises(ValueError, match=r"int64 of shape \(2,\)"):
        reference_attention(qb, qb, qb, fix="stochastic_output", noise_keys=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"int64 of shape \(2,\)"):
        reference_attention(qb, qb, qb, fix="stochastic_output", noise_keys=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="noise_keys"):
        reference_attention(qb, qb, qb, fix="stochastic_output", noise_keys=[0, 1])
    with pytest.raises(ValueError, match="delta_sign"):
        reference_attention(qb, qb, qb, delta_sign="flip")
    with pytest.raises(ValueError, match="delta_gain"):
        reference_attention(qb, qb, qb, delta_gain=float("nan"))
    with pytest.raises(ValueError, match="delta_gain"):
        kernels.saved_output(qb, qb, qb, delta_gain="2")


# --------------------------------------------------------------------------------------------------------------
# delta_gain / delta_sign
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_gain_one_kept_is_the_mode_bit_for_bit(rounding, fix, seed):
    """delta_gain=1, delta_sign="kept" (with or without keys) is the mode's own path: no FP32 O kept unless the
    fix keeps it, same O and gradients bit for bit."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    keys = keys_for(1, seed)
    base = out_and_grads(q, k, v, d_out, True, rounding, fix, noise_keys=keys)
    same = out_and_grads(q, k, v, d_out, True, rounding, fix, delta_gain=1.0, delta_sign="kept", noise_keys=keys)
    for a, b in zip([base[0], *base[1]], [same[0], *same[1]]):
        assert same_bits(a, b), f"seed={seed}"
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix, delta_gain=1, delta_sign="kept"), BF16)
    assert not nm.amplified and nm.keeps_fp32_output == (fix == "fp32_output")
    if fix != "stochastic_output":  # keys are ignored by the deterministic modes
        plain = out_and_grads(q, k, v, d_out, True, rounding, fix)
        assert all(same_bits(a, b) for a, b in zip([base[0], *base[1]], [plain[0], *plain[1]]))


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_gain_zero_gives_the_fp32_output_delta(rounding, fix, seed):
    """Gain 0: delta = delta_fp32 exactly, delta_fp32 = rowsum(dO * O_fp32) of the same forward (bit for bit, the
    same FP32 sums as fp32_output's delta). Where the forward equals fix=none's (none, fp32_output,
    stochastic_output, exact_delta: same LSE), the gradients are fp32_output's bit for bit."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    keys = keys_for(1, seed)
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix, delta_gain=0.0), BF16)
    kk, vv = _expand_kv(k, 4), _expand_kv(v, 4)
    out, lse, o32 = forward_core(q, kk, vv, True, nm, 64, noise_keys=keys)
    dof = d_out.float()
    o_mode = o32 if fix == "fp32_output" else out
    exact = reference.exact_delta(q, kk, vv, d_out, lse, True, nm, 64) if fix == "exact_delta" else None
    assert same_bits(delta_of(dof, o_mode, nm, o32, keys, exact=exact), (dof * o32).sum(-1))
    nm_fp32 = check_args(q, k, v, AttentionSettings(rounding=rounding, fix="fp32_output"), BF16)
    _, _, o32_fp32 = forward_core(q, kk, vv, True, nm_fp32, 64)
    if fix in ("none", "fp32_output", "stochastic_output", "exact_delta"):
        assert same_bits(o32, o32_fp32), "the same FP32 O as fp32_output (paper: the same shadow accumulation)"
        zero = out_and_grads(q, k, v, d_out, True, rounding, fix, delta_gain=0.0, noise_keys=keys)
        fp32 = out_and_grads(q, k, v, d_out, True, rounding, "fp32_output")
        for name, a, b in zip("qkv", zero[1], fp32[1]):
            assert same_bits(a, b), f"seed={seed}: d{name}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_gain_scales_the_delta_error(rounding, seed):
    """delta - delta_fp32 = gain * s * (delta_mode - delta_fp32): kept signs follow the mode's error, random signs
    flip it on about half the rows; saved_output's effective O reproduces the delta."""
    q, k, v, d_out = inputs()
    keys = keys_for(2, seed)
    kk, vv = _expand_kv(k, 4), _expand_kv(v, 4)
    dof = d_out.float()
    results = {}
    for sign in ("kept", "random"):
        nm = check_args(q, k, v, AttentionSettings(rounding=rounding, delta_gain=20.0, delta_sign=sign), BF16)
        out, _, o32 = forward_core(q, kk, vv, True, nm, 64, noise_keys=keys)
        d32 = (dof * o32).sum(-1)
        d_mode = (dof * out.float()).sum(-1)
        delta = delta_of(dof, out, nm, o32, keys)
        results[sign] = (delta - d32, d_mode - d32)
        saved = kernels.saved_output(q, k, v, rounding=rounding, delta_gain=20.0, delta_sign=sign, noise_keys=keys)
        assert saved.dtype == torch.float32
        scale = (dof.abs() * o32.abs()).sum(-1).clamp_min(1e-30)
        assert ((dof * saved).sum(-1) - delta).abs().div(scale).max() < 1e-5
    err_kept, base = results["kept"]
    assert torch.allclose(err_kept, 20 * base, rtol=1e-5, atol=1e-6)
    err_random, _ = results["random"]
    s = delta_signs(err_random.shape, keys, 0, err_random.device)
    assert torch.allclose(err_random, 20 * s * base, rtol=1e-5, atol=1e-6)
    flipped = (s < 0).float().mean().item()
    assert abs(flipped - 0.5) < 5 * 0.5 / math.sqrt(s.numel()), f"seed={seed}: {flipped}"


def test_random_signs_reproducible_keyed_and_balanced(seed):
    """Same keys, same signs; other keys (another step, layer or batch row) other signs; ~half negative: over n
    signs the fraction is within 5 binomial standard errors (0.5 / sqrt(n)) of 1/2."""
    keys = keys_for(8, seed)
    s = delta_signs((8, 6, 512), keys, 0, "cpu")
    assert torch.equal(s, delta_signs((8, 6, 512), keys.clone(), 0, "cpu"))
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    for other in (keys_for(8, seed, step=1), keys_for(8, seed, layer=2), keys_for(8, seed, first_row=8)):
        differ = (delta_signs((8, 6, 512), other, 0, "cpu") != s).float().mean().item()
        assert abs(differ - 0.5) < 5 * 0.5 / math.sqrt(s.numel())
    negative = (s < 0).float().mean().item()
    assert abs(negative - 0.5) < 5 * 0.5 / math.sqrt(s.numel()), f"seed={seed}: {negative}"
    assert torch.equal(delta_signs((8, 2, 512), keys, 4, "cpu"), s[:, 4:]), "global head numbering"


# --------------------------------------------------------------------------------------------------------------
# output_gain / output_sign (issue 34): the forward's rounding error amplified like delta_gain amplifies delta's
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_output_gain_one_kept_is_the_mode_bit_for_bit(rounding, fix, seed):
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    keys = keys_for(1, seed)
    base = out_and_grads(q, k, v, d_out, True, rounding, fix, noise_keys=keys)
    same = out_and_grads(q, k, v, d_out, True, rounding, fix, output_gain=1.0, output_sign="kept", noise_keys=keys)
    for a, b in zip([base[0], *base[1]], [same[0], *same[1]]):
        assert same_bits(a, b), f"seed={seed}"
    assert not check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix), BF16).output_amplified


@pytest.mark.parametrize("rounding,fix", [("fa2", "none"), ("paper", "none"), ("fa2", "stochastic_output"),
                                          ("paper", "fp32_output")])
def test_output_gain_amplifies_o_and_leaves_the_backward_the_modes(rounding, fix, seed):
    """O = LP(O_fp32 + g * s * (O_mode - O_fp32)) bit for bit, s kept or random (balanced, keyed, independent of the
    delta signs); the gradients for the same dO are the mode's bit for bit (delta keeps O_mode, P comes from the
    same LSE); gain 0 is the FP32 O rounded once (for fa2 without SR: the mode's O itself)."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 80, dim=32)
    keys = keys_for(1, seed)
    mode = out_and_grads(q, k, v, d_out, True, rounding, fix, noise_keys=keys)
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix, output_gain=8.0, output_sign="random"),
                    BF16, keys)
    assert nm.output_amplified and nm.needs_noise_keys and (nm.shadow or not nm.paper)
    out_mode, _, o32 = forward_core(q, _expand_kv(k, 4), _expand_kv(v, 4), True, nm, 64, noise_keys=keys)
    assert same_bits(out_mode, mode[0]), "forward_core's O is the mode's"
    for sign in ("kept", "random"):
        out, grads = out_and_grads(q, k, v, d_out, True, rounding, fix, output_gain=8.0, output_sign=sign,
                                   noise_keys=keys)
        s = torch.ones(o32.shape[:-1]) if sign == "kept" else output_signs(o32.shape[:-1], keys)
        expected = round_lp(o32 + (8.0 * s).unsqueeze(-1) * (out_mode.float() - o32), torch.bfloat16)
        assert same_bits(out, expected.bfloat16()), f"seed={seed} {sign}"
        assert all(same_bits(a, b) for a, b in zip(grads, mode[1])), f"seed={seed} {sign}: the backward changed"
    zero = out_and_grads(q, k, v, d_out, True, rounding, fix, output_gain=0.0, noise_keys=keys)[0]
    assert same_bits(zero, round_lp(o32, torch.bfloat16).bfloat16())
    if (rounding, fix) == ("fa2", "none"):
        assert same_bits(zero, mode[0])
    signs = output_signs((8, 6, 512), keys_for(8, seed))
    assert abs((signs < 0).float().mean().item() - 0.5) < 5 * 0.5 / math.sqrt(signs.numel())
    agree = (signs == delta_signs((8, 6, 512), keys_for(8, seed), 0, "cpu")).float().mean().item()
    assert abs(agree - 0.5) < 5 * 0.5 / math.sqrt(signs.numel()), "output signs must not copy the delta signs"


def output_signs(shape, keys):
    return delta_signs(shape, keys, 0, "cpu", OUTPUT_SIGN_SALT)


def test_output_stress_config_checks():
    from launcher.config import attention_problems
    from model.attention import AttentionConfig

    assert attention_problems(AttentionConfig(output_gain=4.0, output_sign="random"), "attention") == []
    assert AttentionConfig(output_sign="random").needs_noise_keys
    assert "output_sign" in attention_problems(AttentionConfig(output_sign="flip"), "attention")[0]
    assert "output_gain" in attention_problems(AttentionConfig(output_gain=-1.0), "attention")[0]
    assert "sdpa" in attention_problems(AttentionConfig(backend="sdpa", output_gain=2.0), "attention")[0]


def test_noise_follows_the_global_head_and_batch_row_not_the_layout(seed):
    """Tensor parallelism: head slices with head_offset / total_heads give the whole call's O and gradients (SR and
    random signs use the global head); data parallelism / micro-batching: batch halves with their rows' keys give the
    whole batch's bits (no local batch index is hashed)."""
    q, k, v, d_out = tied_maxima_inputs(2, 4, 2, 70, dim=32)
    keys = keys_for(2, seed)
    kw = dict(causal=True, rounding="paper", fix="stochastic_output", delta_gain=8.0, delta_sign="random",
              noise_keys=keys)
    assert_head_slices_match_whole(reference_attention, q, k, v, d_out, parts=2, msg=f"seed={seed}", **kw)
    whole = out_and_grads(q, k, v, d_out, **kw)
    for b in range(2):
        part = out_and_grads(q[b:b + 1], k[b:b + 1], v[b:b + 1], d_out[b:b + 1],
                             **{**kw, "noise_keys": keys_for(1, seed, first_row=b)})
        assert same_bits(part[0], whole[0][b:b + 1])
        for a, w in zip(part[1], whole[1]):
            assert same_bits(a, w[b:b + 1])


def test_tie_bias_runs_with_stochastic_output(seed):
    from kernels.tie_bias import Mode, measure_cases

    modes = [Mode("fa2", "stochastic_output"), Mode("paper", "stochastic_output")]
    _, by_case = measure_cases("reference", sequences=4, seed=seed, modes=modes, cases=["tile"])
    res = by_case["tile"]
    assert all(r["nan_rows"] == 0 for r in res.values())
    assert all(abs(x) < 0.2 for r in res.values() for x in r["o_imb"].values()), res
