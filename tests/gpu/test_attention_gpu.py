"""The Triton kernel on a CUDA GPU: accuracy of every mode against fp64 and the reference, bit-level agreement where
designed, the fixes' safety under the GPU's approximate exp2 and flush-to-zero, the tie-bias measurement, torch.compile.

Run on a CUDA machine: ``python -m pytest tests/gpu/test_attention_gpu.py``. Skipped without CUDA. Launches use
the fixed tile configuration (``autotune=False``) so that the reference can use the same key tile and compile time
stays small; the benchmark exercises the autotuned path. Output and gradient buffers start NaN-filled
(``out_fill``), so an element that no launch writes shows up.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import kernels  # noqa: E402
from kernels.tie_bias import Mode, measure_cases  # noqa: E402
from tests.attention_common import (MODES, NAN, assert_head_slices_match_whole, fp64_out_and_grads,  # noqa: E402
                                    head_slices, nan_filled, rel_err, tied_maxima_inputs)

TOL = {torch.bfloat16: {"fa2": 6e-3, "paper": 1.2e-2}, torch.float16: {"fa2": 8e-4, "paper": 1.5e-3}}


flash_attention = nan_filled(kernels.flash_attention, autotune=False)
reference_attention = nan_filled(kernels.reference_attention)
saved_output = nan_filled(kernels.saved_output, autotune=False)


@pytest.fixture(autouse=True)
def compiled_kernels():
    from kernels import triton_flash

    if triton_flash.INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set in this process: the GPU tests need compiled kernels")
    return triton_flash


CASES = ([(r, f, torch.bfloat16, True, 64) for r, f in MODES]
         + [(r, f, dt, c, 64) for r, f in (("fa2", "none"), ("paper", "dynamic_max"), ("fa2", "fp32_output"))
            for dt, c in ((torch.float16, True), (torch.bfloat16, False))]
         + [("fa2", "none", torch.bfloat16, True, 128), ("paper", "dynamic_max", torch.bfloat16, True, 128)])


@pytest.mark.parametrize("rounding,fix,dtype,causal,head_dim", CASES,
                         ids=[f"{r}-{f}-{str(d)[6:]}-{'causal' if c else 'full'}-d{h}" for r, f, d, c, h in CASES])
def test_kernel_matches_reference_and_fp64(rounding, fix, dtype, causal, head_dim, seed):
    seq = int(torch.randint(200, 400, (1,)))
    shape_q, shape_kv = (2, 4, seq, head_dim), (2, 2, seq, head_dim)  # grouped-query: 2 q heads per k/v head
    q = torch.randn(shape_q, device="cuda").to(dtype).requires_grad_()
    k, v = (torch.randn(shape_kv, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    d_out = torch.randn(shape_q, device="cuda").to(dtype)
    out = flash_attention(q, k, v, causal, rounding, fix)
    out.backward(d_out)
    grads = [t.grad for t in (q, k, v)]
    msg = f"seed={seed} seq={seq}"
    assert out.dtype == dtype and torch.isfinite(out).all(), msg
    assert all(torch.isfinite(g).all() for g in grads), msg
    ref_out = reference_attention(q.detach(), k.detach(), v.detach(), causal, rounding, fix, block_n=64)
    # Not bit-exact on the GPU by design: MMA summation order, ex2.approx, FMA contraction of scale and max.
    assert (out != ref_out).float().mean() < 0.05, f"{msg}: too many elements differ from the reference"
    assert rel_err(out, ref_out) < torch.finfo(dtype).eps / 2, msg
    exact_out, exact_grads = fp64_out_and_grads(q, k, v, d_out, causal)
    tol = TOL[dtype][rounding]
    assert rel_err(out, exact_out) < tol, msg
    for name, g, eg in zip("qkv", grads, exact_grads):
        assert rel_err(g, eg) < 2 * tol, f"{msg}: d{name}"


@pytest.mark.parametrize("fix", ["none", "fp32_output"])
def test_paper_rounding_bit_for_bit_where_sums_are_exact(fix, seed):
    """P_bar is exactly 0 or 1 and every sum exact, so only the rounding points decide O (RNE ties included)."""
    seq = int(torch.randint(200, 400, (1,)))
    q = torch.zeros(1, 2, seq, 64)
    k = torch.zeros(1, 2, seq, 64)
    q.scatter_(-1, torch.randint(0, 4, (1, 2, seq, 1)), 32.0)
    k[..., :4] = -7.5
    for a in range(4):
        for h in range(2):
            k[0, h, torch.randperm(seq)[: int(torch.randint(1, 5, (1,)))], a] = 30.0
    v = torch.randint(-128, 128, (1, 2, seq, 64)) / 64.0
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    out = flash_attention(q, k, v, True, "paper", fix)
    ref = reference_attention(q, k, v, True, "paper", fix, block_n=64)
    assert torch.equal(out, ref), f"seed={seed} seq={seq}"


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_head_slices_with_global_index_match_the_whole_call(rounding, parts, seed):
    """Tensor parallelism: head slices with head_offset / total_heads give the bits of one call on all heads (O, dq,
    dk, dv; GQA groups of 2 stay whole), the last slice without its offset differs, and the slice's shifts are the
    reference's (same global index)."""
    seq = int(torch.randint(200, 400, (1,)))
    q, k, v, d_out = (t.cuda() for t in tied_maxima_inputs(2, 8, 4, seq))
    msg = f"seed={seed} seq={seq} parts={parts}"
    kw = dict(causal=True, rounding=rounding, fix="dynamic_max")
    slices = assert_head_slices_match_whole(flash_attention, q, k, v, d_out, parts=parts, msg=msg, **kw)
    sq, sk, sv, _, offset = head_slices(q, k, v, d_out, parts)[-1]
    ref = reference_attention(sq, sk, sv, **kw, block_n=64, head_offset=offset, total_heads=8)
    assert (slices[-1] != ref).float().mean() < 0.05, f"{msg}: too many elements differ from the reference"
    assert rel_err(slices[-1], ref) < torch.finfo(q.dtype).eps / 2, msg


def tied_inputs(logit: float, ties: int, seq: int = 300, dim: int = 64):
    q = torch.zeros(1, 1, seq, dim)
    k = torch.zeros(1, 1, seq, dim)
    q[..., 0] = 1.0
    k[..., 0] = (logit - abs(logit) / 4 - 1) * dim**0.5
    k[:, :, torch.arange(ties), 0] = logit * dim**0.5
    return (q.cuda().bfloat16(), k.cuda().bfloat16(), torch.ones(1, 1, seq, dim, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_safe_fix_never_nan_inf_or_zeroed(rounding):
    for logit, ties in [(0.0, 2), (0.0, 300), (1.0, 2), (80.0, 3), (120.0, 2), (1e4, 2), (1e30, 2), (-120.0, 2)]:
        out = flash_attention(*tied_inputs(logit, ties), False, rounding, "dynamic_max")
        ok = torch.isfinite(out).all() and ((out.float() - 1).abs() <= 2**-6).all()
        assert ok, f"logit={logit} ties={ties}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_published_rule_failure_reproduced(rounding):
    out = flash_attention(*tied_inputs(120.0, 2), False, rounding, "dynamic_max_published")
    assert (out == 0).all(), "zeroed rows (the authors' row-sum clamp; NaN without it)"
    out = flash_attention(*tied_inputs(20.0, 2), False, rounding, "dynamic_max_published", beta=7.0)
    assert (out == 0).all()


def test_tie_bias_on_gpu(seed):
    modes = [Mode("paper", "none"), Mode("paper", "dynamic_max"), Mode("fa2", "none"), Mode("fa2", "dynamic_max")]
    _, by_case = measure_cases("triton", sequences=32, seed=seed, modes=modes, cases=["tile", "sink"], autotune=False)
    res, sink = by_case["tile"], by_case["sink"]
    assert -0.32 < res["paper/none"]["o_imb"][2] < -0.18, f"seed={seed}: {res['paper/none']}"
    assert all(abs(x) < 0.05 for x in res["fa2/dynamic_max"]["o_imb"].values()), f"seed={seed}"
    # k=1 rows carry the rounding of l = bf16(1 + eps) in the tile case's whole-row paper tile, ~-0.2 ulp, fix or not
    paper_fixed = res["paper/dynamic_max"]["o_imb"]
    assert all(abs(paper_fixed[k]) < 0.13 for k in (2, 3, 4)), f"seed={seed}: {paper_fixed}"
    assert sink["fa2/none"]["o_imb"][2] > 0.15, f"seed={seed}: the fa2 midpoint bias of sink-like V: {sink}"
    assert all(abs(sink["fa2/dynamic_max"]["o_imb"][t]) < 0.03 for t in (2, 3, 4)), f"seed={seed}: {sink}"
    assert all(r["nan_rows"] == 0 and r["zero_rows"] == 0 for c in by_case.values() for r in c.values())


@pytest.mark.parametrize("head_offset,total_heads", [(0, 0), (4, 12)], ids=["unsharded", "heads-4-7-of-12"])
def test_torch_compile_inductor(seed, head_offset, total_heads):
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda").bfloat16().requires_grad_() for _ in range(3))

    def step(q, k, v):
        return flash_attention(q * 1.0, k, v, True, "paper", "dynamic_max", head_offset=head_offset,
                                       total_heads=total_heads).float().square().mean()

    loss = torch.compile(step, fullgraph=True)(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    for a, t in zip(grads, (q, k, v)):
        assert rel_err(a, t.grad) < 1e-2


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_cached_launch_equals_tritons_launch(compiled_kernels, monkeypatch, rounding, fix, seed):
    """The cached launch path (``_Kernel``: the binary called directly after its first launch) gives the same bits
    as Triton's own launch path, for model-layout inputs and for inputs that are not 16-byte aligned (views at an
    odd element offset: another specialisation, so another binary); outputs and gradients follow the inputs'
    layout."""
    tf = compiled_kernels
    msg = f"seed={seed} {rounding}/{fix}"

    def inputs(offset):
        flat = torch.randn(4 * 2 * 300 * 4 * 64 + offset, device="cuda").bfloat16()
        base = flat[offset:].view(4, 2, 300, 4, 64)  # (B, T, H, D) projections of q, k, v, dO
        return [base[i].transpose(1, 2) for i in range(4)]

    def run(fast, q, k, v, d_out):
        monkeypatch.setattr(tf, "FAST_LAUNCH", fast)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]  # views: keep the offset
        out = flash_attention(*leaves, True, rounding, fix)
        out.backward(d_out)
        return out, [t.grad for t in leaves], leaves

    for offset in (0, 3):
        q, k, v, d_out = inputs(offset)
        assert (q.data_ptr() % 16 == 0) == (offset == 0)
        expected = run(False, q, k, v, d_out)
        for _ in range(3):  # the first call of a combination fills the cache, later ones use it
            got = run(True, q, k, v, d_out)
            assert torch.equal(got[0], expected[0]), f"{msg} offset={offset}: O"
            for name, a, b in zip("qkv", got[1], expected[1]):
                assert torch.equal(a, b), f"{msg} offset={offset}: d{name}"
        assert got[0].stride() == got[2][0].stride(), msg
        assert all(g.stride() == t.stride() for g, t in zip(got[1], got[2])), msg
    assert len(tf.FWD.binaries) >= 2, "the aligned and the unaligned call should have their own binaries"


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_tma_loads_give_the_pointer_loads_bits(compiled_kernels, monkeypatch, rounding, fix, seed):
    """dQ reads k and v through TMA descriptors where it may (``_tma_ok``): the same gradients, bit for bit, as its
    pointer loads, with a ragged last tile (TMA's zero fill past the sequence) and grouped-query heads, in the
    model's layout."""
    tf = compiled_kernels
    seq = int(torch.randint(200, 400, (1,)))
    q = torch.randn(2, seq, 4, 64, device="cuda").bfloat16().transpose(1, 2)
    k, v = (torch.randn(2, seq, 2, 64, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    d_out = torch.randn_like(q)
    monkeypatch.setattr(tf, "TMA", True)  # (off by default: slower here, docs/attention-kernel.md "Speed")
    assert tf._tma_ok(k, v), "an H100/H200 with aligned model-layout inputs should take the TMA path"

    def grads(tma):
        monkeypatch.setattr(tf, "TMA", tma)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, True, rounding, fix).backward(d_out)
        return [t.grad for t in leaves]

    expected = grads(False)
    got = grads(True)
    for name, a, b in zip("qkv", got, expected):
        assert torch.equal(a, b), f"seed={seed} seq={seq}: d{name}"
    descriptor_binaries = [key for key in tf.DQ.binaries if any(arg[0] == "desc" for arg in key[-1])]
    assert descriptor_binaries, "no dQ launch went through the descriptors"


@pytest.mark.parametrize("tma", [True, False], ids=["tma-reduce", "pointer-atomics"])
@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_atomic_dq_backward_matches_the_deterministic_one(compiled_kernels, monkeypatch, rounding, fix, tma, seed):
    """``deterministic=False``: dQ added into an FP32 buffer by the dK/dV launch (a TMA reduction, or pointer
    atomics), in whatever order the tiles finish. dK and dV are the deterministic launch's bit for bit; dQ is
    the same FP32 sum in another order, so it may differ in the last bits: nearly all elements identical, none
    further off than 2^-6 of the largest. Ragged last tile, grouped-query heads, model
    layout; the fixed tiles, and for two modes the autotuned ones (whose tuning runs must leave no share behind)."""
    tf = compiled_kernels
    seq = int(torch.randint(200, 400, (1,)))
    q = torch.randn(2, seq, 4, 64, device="cuda").bfloat16().transpose(1, 2)
    k, v = (torch.randn(2, seq, 2, 64, device="cuda").bfloat16().transpose(1, 2) for _ in range(2))
    d_out = torch.randn_like(q)
    monkeypatch.setattr(tf, "TMA", tma)
    reductions = []
    make_descriptor = tf._rows_descriptor
    monkeypatch.setattr(tf, "_rows_descriptor", lambda t, rows_key: reductions.append(rows_key == "BLOCK_M")
                        or make_descriptor(t, rows_key))

    def grads(deterministic, autotune):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        kernels.flash_attention(*leaves, True, rounding, fix, autotune=autotune, out_fill=NAN,
                                deterministic=deterministic).backward(d_out)
        return [t.grad for t in leaves]

    # the tuned tiles for the fixed arms' numerics (each tuning times 8 configurations of each backward)
    for autotune in (False, True) if (rounding, fix) in (("fa2", "none"), ("fa2", "fp32_output")) else (False,):
        expected = grads(True, autotune)
        got = grads(False, autotune)
        msg = f"seed={seed} seq={seq} autotune={autotune}"
        for name, a, b in zip("qkv", got, expected):
            a, b = a.float(), b.float()
            assert torch.isfinite(a).all(), f"{msg}: d{name}"
            if name != "q" and not autotune:  # same tiles, same code: dK and dV bit for bit
                assert torch.equal(a, b), f"{msg}: d{name}"
            # (tuned tiles may differ between the two backwards, and so the order of every FP32 sum; an element
            # whose sum cancels moves by more than its own ulp, so the bound is relative to the largest element)
            assert ((a - b).abs() <= 2 ** -6 * b.abs().max()).all(), f"{msg}: d{name} max diff {(a - b).abs().max()}"
            assert (a != b).float().mean() < 0.05, f"{msg}: d{name} differs in too many elements"
    assert any(reductions) == tma, "the TMA reduction should run exactly when TMA is on"


# --------------------------------------------------------------------------------------------------------------
# Noise keys: fix=stochastic_output and the delta-error stress (delta_gain / delta_sign)
# --------------------------------------------------------------------------------------------------------------


def _keys(batch, seed, first_row=0):
    from kernels.rounding import layer_keys, row_keys

    return layer_keys(row_keys(seed, 3, torch.arange(first_row, first_row + batch, device="cuda")), 1)


NOISE_CASES = [(r, f, kw) for r in kernels.ROUNDINGS for f, kw in (
    ("stochastic_output", {}), ("none", dict(delta_gain=20.0, delta_sign="random")),
    ("fp32_output", dict(delta_gain=5.0)), ("dynamic_max", dict(delta_gain=10.0)),
    ("stochastic_output", dict(delta_gain=0.0)))]


@pytest.mark.parametrize("rounding,fix,extra", NOISE_CASES,
                         ids=[f"{r}-{f}-{kw.get('delta_gain', 1)}{kw.get('delta_sign', '')}" for r, f, kw in NOISE_CASES])
def test_noise_modes_match_reference(rounding, fix, extra, seed):
    """The compiled Triton paths of the noise modes (SR epilogue, amplified delta launch) against the reference,
    with grouped-query heads and a global head offset: O within the usual GPU tolerance (exp2 and MMA order differ),
    gradients close."""
    seq = int(torch.randint(200, 400, (1,)))
    q = torch.randn(2, 4, seq, 64, device="cuda").bfloat16()
    k, v = (torch.randn(2, 2, seq, 64, device="cuda").bfloat16() for _ in range(2))
    d_out = torch.randn(2, 4, seq, 64, device="cuda").bfloat16()
    kw = dict(extra, noise_keys=_keys(2, seed), head_offset=4, total_heads=8)
    results = []
    for fn in (flash_attention, reference_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, True, rounding, fix, **kw)
        out.backward(d_out)
        results.append((out.detach(), [t.grad for t in leaves]))
    (out, grads), (ref_out, ref_grads) = results
    msg = f"seed={seed} seq={seq}"
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads), msg
    assert (out != ref_out).float().mean() < 0.05, msg
    assert rel_err(out, ref_out) < torch.finfo(out.dtype).eps, msg
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 2e-2, f"{msg}: d{name}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_stochastic_output_bit_for_bit_where_sums_are_exact(rounding, seed):
    """P_bar exactly 0 or 1, every sum exact: the FP32 O is the reference's, so the SR bits must be too."""
    seq = int(torch.randint(200, 400, (1,)))
    q = torch.zeros(1, 2, seq, 64)
    k = torch.zeros(1, 2, seq, 64)
    q.scatter_(-1, torch.randint(0, 4, (1, 2, seq, 1)), 32.0)
    k[..., :4] = -7.5
    for a in range(4):
        for h in range(2):
            k[0, h, torch.randperm(seq)[: int(torch.randint(1, 5, (1,)))], a] = 30.0
    v = torch.randint(-128, 128, (1, 2, seq, 64)) / 64.0
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    keys = _keys(1, seed)
    out = flash_attention(q, k, v, True, rounding, "stochastic_output", noise_keys=keys)
    ref = reference_attention(q, k, v, True, rounding, "stochastic_output", block_n=64, noise_keys=keys)
    assert torch.equal(out, ref), f"seed={seed} seq={seq}"


@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_gain_one_is_the_mode_and_gain_zero_the_fp32_output_delta(rounding, fix, seed):
    """Gain 1 kept (keys or not) is the mode's path bit for bit, without an FP32 O unless the fix keeps one; gain 0
    gives fp32_output's gradients bit for bit. (Both delta launches are compiled without FP fusion: with FMA
    contraction in the plain one, 1-21 gradient elements differed; docs/device-runs/2026-12-01-house/README.md.)"""
    from kernels import ops
    from kernels.modes import AttentionSettings

    q, k, v, d_out = (torch.randn(2, 4, 300, 64, device="cuda").bfloat16() for _ in range(4))
    keys = _keys(2, seed)

    def run(fix, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, True, rounding, fix, **kw)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in leaves]

    base = run(fix, noise_keys=keys)
    same = run(fix, delta_gain=1.0, delta_sign="kept", noise_keys=keys)
    assert all(torch.equal(a, b) for a, b in zip(base, same)), f"seed={seed}"
    settings = AttentionSettings(rounding=rounding, fix=fix, backend="triton", autotune=False, out_fill=NAN)
    o32 = ops.flash_fwd(q, k, v, keys, "triton", *ops.settings_fields(settings))[2]
    assert (o32.numel() > 0) == (fix == "fp32_output")
    if fix in ("none", "stochastic_output"):
        zero, fp32 = run(fix, delta_gain=0.0, noise_keys=keys), run("fp32_output")
        for name, a, b in zip("qkv", zero[1:], fp32[1:]):
            assert torch.equal(a, b), f"seed={seed}: d{name}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_torch_compile_inductor_with_noise_arguments(rounding, seed):
    """Inductor around the custom ops with noise keys and the gain arguments: the same bits as eager."""
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda").bfloat16().requires_grad_() for _ in range(3))
    keys = _keys(2, seed)

    def step(q, k, v, keys):
        return flash_attention(q * 1.0, k, v, True, rounding, "stochastic_output", head_offset=4,
                                       total_heads=12, delta_gain=10.0, delta_sign="random",
                                       noise_keys=keys).float().square().mean()

    loss = torch.compile(step, fullgraph=True)(q, k, v, keys)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = step(q, k, v, keys)
    eager.backward()
    assert rel_err(loss, eager) < 1e-6
    for a, t in zip(grads, (q, k, v)):
        assert rel_err(a, t.grad) < 1e-3


def test_stochastic_output_unbiased_on_gpu(seed):
    """Over 512 keys (batch rows of identical inputs), the mean of the SR'd O is the FP32 O within 5 standard
    errors per element (se <= ulp / (2 sqrt(512)); see tests/unit/test_attention_noise.py for the bound), while
    fix=none's RNE O is a fixed rounding."""
    from kernels.rounding import bf16_ulp

    n = 512
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda").bfloat16().expand(n, -1, -1, -1).contiguous()
               for _ in range(3))
    keys = _keys(n, seed)
    out = flash_attention(q, k, v, True, "fa2", "stochastic_output", noise_keys=keys).double()
    o32 = saved_output(q[:1], k[:1], v[:1], rounding="fa2", fix="fp32_output", backend="triton").double()
    ulp = bf16_ulp(o32)
    mean_err = ((out - o32) / ulp).mean(0)
    assert (mean_err.abs() < 5 * 0.5 / n**0.5).float().mean() > 0.999, f"seed={seed}"
    assert abs(mean_err.mean().item()) < 5 * 0.5 / (n * mean_err.numel()) ** 0.5, f"seed={seed}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_exact_delta_and_exact_reference_on_gpu(rounding, seed):
    """Issue 34 on the GPU (fixed tiles): exact_delta's gradients against the reference's; gain 0 with
    delta_reference=exact gives exact_delta's bit for bit (the gain launch adds gain * 0 to the exact pass's delta);
    the exact pass's delta against FP64 rowsum(P * dP) / rowsum(P) within the reference's bound plus 2^-16 of the
    terms' size for the GPU's MMA accumulation and ex2.approx (not IEEE; a bound of this test, not derived)."""
    from kernels import triton_flash as tf
    from kernels.modes import AttentionSettings
    from tests.unit.test_attention_exact_delta import fp64_rowsum_p_dp, gamma

    q, k, v, d_out = (t.cuda() for t in tied_maxima_inputs(2, 4, 2, 300))
    keys = _keys(2, seed)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, True, rounding, noise_keys=keys, **kw)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in leaves]

    exact = run(flash_attention, fix="exact_delta")
    ref = run(reference_attention, fix="exact_delta", block_n=64)
    for name, a, b in zip("Oqkv", exact, ref):
        assert rel_err(a, b) < 2e-2, f"seed={seed}: {name}"
    zero = run(flash_attention, fix="none", delta_gain=0.0, delta_reference="exact")
    assert all(torch.equal(a, b) for a, b in zip(exact, zero)), f"seed={seed}"
    settings = AttentionSettings(backend="triton", rounding=rounding, fix="exact_delta", autotune=False)
    nm = tf.prepare(q, k, v, settings)
    out, lse, _, _ = tf.forward(q, k, v, settings, nm)
    launches, _ = tf._backward_launches(d_out, q, k, v, out, lse, settings, nm)
    launches[0]()
    delta64, size = fp64_rowsum_p_dp(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), d_out, lse, True, nm)
    err = (launches[0].tensors[-1].double() - delta64).abs()
    assert (err <= (gamma(2 * 300 + 64) + 2.0**-16) * size).all(), f"seed={seed}: {(err / size).max().item():.2e}"


@pytest.mark.parametrize("rounding,fix", [("fa2", "none"), ("paper", "stochastic_output"), ("fa2", "fp32_output")])
def test_output_gain_on_gpu(rounding, fix, seed):
    """The output stress in the kernel's epilogue against the reference (the GPU may fuse the multiply-add: nearly
    all elements equal, the rest within an ulp), the backward unchanged bit for bit, gain 1 kept the mode's bits."""
    q, k, v, d_out = (t.cuda() for t in tied_maxima_inputs(2, 4, 2, 300))
    keys = _keys(2, seed)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, True, rounding, fix, noise_keys=keys, **kw)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in leaves]

    stressed = run(flash_attention, output_gain=8.0, output_sign="random")
    ref = run(reference_attention, output_gain=8.0, output_sign="random", block_n=64)
    assert (stressed[0] != ref[0]).float().mean() < 0.05 and rel_err(stressed[0], ref[0]) < 1e-2, f"seed={seed}"
    mode = run(flash_attention)
    assert all(torch.equal(a, b) for a, b in zip(stressed[1:], mode[1:])), f"seed={seed}: the backward changed"
    assert all(torch.equal(a, b) for a, b in zip(run(flash_attention, output_gain=1.0), mode)), f"seed={seed}"
