"""The Triton kernel under the interpreter (CPU): bit-level agreement with the reference where designed, accuracy
of every mode against fp64, the fixes' safety, custom-op / autograd / torch.compile plumbing.

TRITON_INTERPRET=1 is set here while kernels.triton_flash is first imported (kernels imports it lazily, and Triton
decides at decoration time), then restored, and set again only while this module's tests run. Shapes are tiny: the
interpreter runs numpy per program and per loop iteration. In a process that already imported the compiled
kernels (a GPU session running everything), this module skips: run tests/gpu on its own there.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels
from kernels import ops
from kernels.modes import AttentionSettings
from tests.attention_common import (MODES, NAN, assert_head_slices_match_whole, fp64_out_and_grads, head_slices,
                                    nan_filled, out_and_grads, rel_err, same_bits, tied_maxima_inputs)

_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton_flash = pytest.importorskip("kernels.triton_flash")
finally:
    if _PREVIOUS is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS
if not triton_flash.INTERPRET:  # pragma: no cover - another module imported the compiled kernels first
    pytest.skip("kernels.triton_flash was imported without TRITON_INTERPRET=1", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def interpreter_env():
    """Kernels defined inside tests (rounding helper, hash) must be decorated as interpreted too."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous

BLOCK_N = triton_flash.FIXED_FWD["BLOCK_N"]


# Every call here starts from NaN-filled output and gradient buffers, so an element a launch misses shows up.
flash_attention = nan_filled(kernels.flash_attention)
reference_attention = nan_filled(kernels.reference_attention)
saved_output = nan_filled(kernels.saved_output)


def op_fields(**named):
    """The custom ops' settings arguments: the fields of AttentionSettings(backend="triton", **named), in order."""
    return ops.settings_fields(AttentionSettings(backend="triton", **named))


def fwd_op(q, k, v, noise_keys=None, **named):
    """The forward custom op (what torch.compile calls) of the Triton kernel with these settings."""
    return ops.flash_fwd(q, k, v, noise_keys, "triton", *op_fields(**named))


def assert_matches_reference(out, ref, msg=""):
    """Nearly all elements bit-identical, the rest within a few LP ulps (see test_kernel_matches_reference...)."""
    assert (out != ref).float().mean() < 0.02, f"{msg}: O differs from the reference in too many elements"
    assert rel_err(out, ref) < torch.finfo(out.dtype).eps / 4, f"{msg}: O differs from the reference"


def run_both(q, k, v, d_out, causal, rounding, fix):
    """(kernel out, kernel grads), (reference out, reference grads) on the same leaves."""
    results = []
    for fn in (flash_attention, reference_attention):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, causal, rounding, fix)
        out.backward(d_out)
        results.append((out.detach(), [t.grad.clone() for t in (q, k, v)]))
    return results


TOL = {torch.bfloat16: {"fa2": 6e-3, "paper": 1.2e-2}, torch.float16: {"fa2": 8e-4, "paper": 1.5e-3}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding,fix", MODES, ids=[f"{r}-{f}" for r, f in MODES])
def test_kernel_matches_reference_and_fp64(rounding, fix, causal, dtype, seed):
    if fix == "stochastic_output" and dtype == torch.float16:
        pytest.skip("stochastic_output is bf16 only (fp16 inputs are refused: see test_stochastic_output_refuses_fp16)")
    seq = int(torch.randint(65, 131, (1,)))  # ragged tail, two or three key tiles
    q = torch.randn(1, 2, seq, 64).to(dtype).requires_grad_()
    k, v = (torch.randn(1, 2, seq, 64).to(dtype).requires_grad_() for _ in range(2))
    d_out = torch.randn(1, 2, seq, 64).to(dtype)
    (out, grads), (ref_out, ref_grads) = run_both(q, k, v, d_out, causal, rounding, fix)
    msg = f"seed={seed} seq={seq}"
    assert out.dtype == dtype and torch.isfinite(out).all(), msg
    assert all(torch.isfinite(g).all() for g in grads), msg
    # Against the reference: same rounding points, so O is bit-identical except where an FP32 result that is not
    # bit-reproducible across libraries (numpy's vs torch's exp2, or a sum in another order) lands on the other side
    # of an LP rounding boundary (a score S or a P_bar flips by one LP ulp; fp16 flips ~8x more often than bf16,
    # having 3 more mantissa bits). Its row of O then moves by a few ulps. So: nearly all elements bit-identical,
    # and the rest close.
    assert_matches_reference(out, ref_out, msg)
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 2e-3, f"{msg}: d{name} differs from the reference"
    exact_out, exact_grads = fp64_out_and_grads(q, k, v, d_out, causal)
    tol = TOL[dtype][rounding]
    assert rel_err(out, exact_out) < tol, msg
    for name, g, eg in zip("qkv", grads, exact_grads):
        assert rel_err(g, eg) < 2 * tol, f"{msg}: d{name} vs fp64"


def exact_arithmetic_inputs(seq: int, causal: bool):
    """Inputs where every sum is exact in FP32, so kernel and reference must agree bit for bit in O.

    Each row's query picks one of 4 anchor directions; the keys of an anchor score 120 (tied, 1 to 4 copies, some
    across tiles), every other key scores 0 or -30, so P_bar is exactly 1 or exactly 0 (exp of <= -120 underflows
    in FP32). V values are multiples of 2^-6 in [-2, 2), so the sums of P_bar V are exact and only the explicit
    rounding points (ties of round-to-nearest-even included) decide the result.
    """
    q = torch.zeros(1, 2, seq, 64)
    k = torch.zeros(1, 2, seq, 64)
    anchor = torch.randint(0, 4, (1, 2, seq))
    q.scatter_(-1, anchor.unsqueeze(-1), 32.0)
    k[..., :4] = -30.0 * 8 / 32  # score -30 against every anchor
    for a in range(4):
        for h in range(2):
            pos = torch.randperm(seq)[: int(torch.randint(1, 5, (1,)))]
            k[0, h, pos, a] = 30.0  # score 32 * 30 / 8 = 120
    v = torch.randint(-128, 128, (1, 2, seq, 64)) / 64.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding,fix", [(r, f) for r in kernels.ROUNDINGS for f in ("none", "fp32_output")])
def test_bit_for_bit_where_sums_are_exact(rounding, fix, causal, seed):
    seq = int(torch.randint(65, 131, (1,)))
    q, k, v = exact_arithmetic_inputs(seq, causal)
    out = flash_attention(q, k, v, causal, rounding, fix)
    ref = reference_attention(q, k, v, causal, rounding, fix, block_n=BLOCK_N)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"seed={seed} seq={seq}"
    saved = saved_output(q, k, v, causal=causal, rounding=rounding, fix=fix, backend="triton")
    ref_saved = saved_output(q, k, v, causal=causal, rounding=rounding, fix=fix)
    assert torch.equal(saved, ref_saved), f"seed={seed} seq={seq}"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("seq,tile", [(256, 64), (256, 128), (200, 0)], ids=["tile64", "tile128", "whole-row"])
def test_paper_tiles_bit_for_bit_where_sums_are_exact(seq, tile, causal, seed):
    """Paper tiles of 64 and 128 keys (2 key blocks per tile: two passes, one rounding) and the whole row; ties in
    and across tiles, rows that see no key of a tile (causal): kernel and reference agree bit for bit."""
    q, k, v = exact_arithmetic_inputs(seq, causal)
    kw = dict(causal=causal, rounding="paper", paper_block_keys=tile)
    out = flash_attention(q, k, v, **kw)
    ref = reference_attention(q, k, v, **kw)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"seed={seed} seq={seq} tile={tile}"
    saved = saved_output(q, k, v, fix="fp32_output", backend="triton", **kw)
    assert torch.equal(saved, saved_output(q, k, v, fix="fp32_output", **kw)), f"seed={seed}"


def test_paper_tile_starting_inside_a_query_block(monkeypatch, seed):
    """128-query blocks (as the GPU configurations use) with 64-key paper tiles: the causal diagonal block holds a
    tile that the block's first 64 rows cannot see; it must leave them exactly as they were."""
    monkeypatch.setitem(triton_flash.FIXED_FWD, "BLOCK_M", 128)
    q, k, v = exact_arithmetic_inputs(300, True)
    out = flash_attention(q, k, v, True, "paper", paper_block_keys=64)
    ref = reference_attention(q, k, v, True, "paper", paper_block_keys=64)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"seed={seed}"


@pytest.mark.parametrize("fix", ["none", "dynamic_max", "dynamic_max_published"])
def test_paper_tiles_match_reference_with_ties(fix, seed):
    """Random inputs whose row maxima repeat, 128-key paper tiles over 64-key blocks: the tile max and the tie test
    of pass 1 (over two blocks) agree with the reference's over the whole tile; O nearly bit-identical, gradients
    close (the backward recomputes P with the same score rounding)."""
    q, k, v, d_out = (t.requires_grad_() if i < 3 else t for i, t in enumerate(tied_maxima_inputs(1, 2, 2, 256)))
    results = []
    for fn in (flash_attention, reference_attention):
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v, True, "paper", fix, paper_block_keys=128)
        out.backward(d_out)
        results.append((out.detach(), [t.grad.clone() for t in (q, k, v)]))
    (out, grads), (ref_out, ref_grads) = results
    assert_matches_reference(out, ref_out, f"seed={seed} {fix}")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 2e-3, f"seed={seed} {fix}: d{name} differs from the reference"


def test_autotune_keeps_key_blocks_inside_a_paper_tile():
    configs = triton_flash._configs(triton_flash._FWD_CONFIGS)
    meta = dict(HEAD_DIM=64, PAPER=True)
    assert {c.kwargs["BLOCK_N"] for c in triton_flash._prune_configs(configs, {}, PAPER_TILE=64, **meta)} == {64}
    assert len(triton_flash._prune_configs(configs, {}, PAPER_TILE=0, **meta)) == len(configs)
    assert len(triton_flash._prune_configs(configs, {}, PAPER_TILE=0, HEAD_DIM=64, PAPER=False)) == len(configs)


def test_rounding_helper_in_kernel_is_bitwise_rne(seed):
    """The kernel's _round_lp (explicit bit rounding under the interpreter) equals torch's RNE cast."""
    import triton
    import triton.language as tl

    @triton.jit
    def _round_kernel(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < N)
        tl.store(Y + offs, triton_flash._round_lp(x, True, True), mask=offs < N)

    ties = (torch.randint(-(2**15), 2**15, (96,), dtype=torch.int32) * 65536 + 0x8000).view(torch.float32)
    x = torch.cat([torch.randn(4000) * 1e3, ties[~torch.isnan(ties)], torch.tensor([float("inf"), -0.0, 0.0])])
    y = torch.full_like(x, float("nan"))
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.view(torch.int32), x.bfloat16().float().view(torch.int32))


def test_safe_shift_in_kernel_matches_reference_bitwise(seed):
    import triton
    import triton.language as tl

    from kernels.rounding import safe_shift

    @triton.jit
    def _shift_kernel(R, ROWS, BH, D, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r_m = tl.load(R + offs, mask=offs < N)
        rows = tl.load(ROWS + offs, mask=offs < N)
        bh = tl.load(BH + offs, mask=offs < N)
        tl.store(D + offs, triton_flash._safe_shift(r_m, rows, bh), mask=offs < N)

    n = 4096
    r_m = torch.cat([torch.randn(n - 6) * 100, torch.tensor([0.0, -0.0, 1e30, -1e30, float("-inf"), 3.0])])
    rows = torch.randint(0, 1 << 20, (n,), dtype=torch.int32)
    bh = torch.randint(0, 1 << 12, (n,), dtype=torch.int32)
    out = torch.full((n,), float("nan"))
    _shift_kernel[(triton.cdiv(n, 1024),)](r_m, rows, bh, out, n, BLOCK=1024)
    assert torch.equal(out, safe_shift(r_m, rows, bh)), f"seed={seed}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_tied_rows_match_reference(rounding, seed):
    """Rows with repeated maxima (the tie-bias inputs): the fixes' per-row shifts agree with the reference.
    The tie-bias "tile" construction at 128 keys instead of 256 (the interpreter's cost grows with query tiles x key
    tiles): still 2 query and 2 key tiles of 64 (a running maximum carried across tiles), and rows tied 1 to 4 times
    inside a tile."""
    import dataclasses

    from kernels.tie_bias import CASES, build_inputs

    case = dataclasses.replace(CASES["tile"], seq=2 * BLOCK_N)
    q, k, v, _, _ = build_inputs(2, torch.Generator().manual_seed(seed), case)
    assert q.shape[-2] == 2 * BLOCK_N == 128
    for fix in ("dynamic_max", "dynamic_max_published"):
        out = flash_attention(q, k, v, False, rounding, fix)
        ref = reference_attention(q, k, v, False, rounding, fix, block_n=BLOCK_N)
        assert (out != ref).float().mean() < 0.02 and rel_err(out, ref) < 1e-3, f"seed={seed} {fix}"


def test_fa2_safe_fix_triggers_on_ties_across_tiles_like_the_reference(seed):
    """One copy of each row's maximum key in each of three 64-key tiles (no tie inside a tile): fa2/dynamic_max
    shifts those rows (LSE and O differ from none) exactly where the reference does."""
    seq, dim = 192, 32
    k = torch.randn(1, 1, seq, dim)
    anchor = 2.0 * torch.randn(dim)
    k[0, 0, [5, 70, 150]] = anchor
    q = (1.5 * anchor + 0.3 * torch.randn(1, 1, seq, dim)).bfloat16()
    k, v = k.bfloat16(), torch.randn(1, 1, seq, dim).bfloat16()
    fixed = flash_attention(q, k, v, False, "fa2", "dynamic_max")
    ref = reference_attention(q, k, v, False, "fa2", "dynamic_max", block_n=BLOCK_N)
    none = flash_attention(q, k, v, False, "fa2", "none")
    assert_matches_reference(fixed, ref, f"seed={seed}")
    assert (fixed != none).any(-1).float().mean() > 0.2, f"seed={seed}: the cross-tile trigger did not shift"


@pytest.mark.parametrize("head_dim", [32, 128])
def test_head_dims_and_gqa(head_dim, seed):
    q = torch.randn(1, 4, 80, head_dim).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 2, 80, head_dim).bfloat16().requires_grad_() for _ in range(2))
    d_out = torch.randn(1, 4, 80, head_dim).bfloat16()
    for rounding, fix in (("fa2", "none"), ("paper", "dynamic_max")):
        (out, grads), (ref_out, ref_grads) = run_both(q, k, v, d_out, True, rounding, fix)
        assert grads[1].shape == k.shape
        assert_matches_reference(out, ref_out, f"seed={seed}")
        for g, rg in zip(grads, ref_grads):
            assert rel_err(g, rg) < 2e-3, f"seed={seed}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_head_slices_with_global_index_match_the_whole_call(rounding, seed):
    """The kernel hashes the global head index (b * total_heads + head_offset + h): two head slices, as two
    tensor-parallel ranks see them, give the bits of one call on all heads in O, dq, dk, dv (GQA groups of 2); the
    last slice without its offset differs; and the slice's shifts are the reference's (same global index)."""
    seq = int(torch.randint(65, 100, (1,)))
    q, k, v, d_out = tied_maxima_inputs(2, 4, 2, seq, dim=16)
    msg = f"seed={seed} seq={seq}"
    kw = dict(causal=True, rounding=rounding, fix="dynamic_max")
    slices = assert_head_slices_match_whole(flash_attention, q, k, v, d_out, msg=msg, **kw)
    sq, sk, sv, _, offset = head_slices(q, k, v, d_out, 2)[-1]
    ref = reference_attention(sq, sk, sv, **kw, block_n=BLOCK_N, head_offset=offset, total_heads=4)
    assert_matches_reference(slices[-1], ref, msg)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rounding,fix", [("fa2", "none"), ("paper", "dynamic_max"), ("fa2", "fp32_output")])
def test_atomic_dq_backward_gives_the_deterministic_bits_in_program_order(monkeypatch, rounding, fix, causal, seed):
    """``deterministic=False``: dQ accumulated with FP32 atomics inside the dK/dV launch, then scaled and
    rounded by its own small launch (GQA groups of 2, a ragged last tile). dK and dV come from the same code: bit
    for bit. The interpreter runs the dK/dV programs one after another, key tile by key tile, so each query row
    receives its shares in the order the dQ launch sums them; only the products differ (dS^T there, dS here:
    numpy may sum a transposed product in another order, which moved 1-21 of ~13,000 dq elements in 4 of 240 cases
    of 40 seeds), so dq is nearly all bit for bit. On a GPU the order varies (tests/gpu)."""
    seq = int(torch.randint(65, 140, (1,)))
    q = torch.randn(1, 4, seq, 32).bfloat16()
    k, v = (torch.randn(1, 2, seq, 32).bfloat16() for _ in range(2))
    d_out = torch.randn(1, 4, seq, 32).bfloat16()
    kw = dict(causal=causal, rounding=rounding, fix=fix)
    _, expected = out_and_grads(flash_attention, q, k, v, d_out, **kw)
    monkeypatch.setattr(triton_flash, "DQ", None)  # the deterministic dQ launch must not run
    _, got = out_and_grads(flash_attention, q, k, v, d_out, deterministic=False, **kw)
    assert same_bits(got[1], expected[1]) and same_bits(got[2], expected[2]), f"seed={seed} seq={seq}: dk/dv"
    dq, ref = got[0].float(), expected[0].float()
    assert (dq != ref).float().mean() < 0.01, f"seed={seed} seq={seq}: dq differs in too many elements"
    assert ((dq - ref).abs() <= 2 ** -7 * ref.abs().max()).all(), f"seed={seed} seq={seq}: dq"


def test_non_contiguous_inputs(seed):
    """(batch, seq, heads, dim) storage seen through a transpose, as a model produces it."""
    base = [torch.randn(1, 70, 2, 64).bfloat16() for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    out = flash_attention(q, k, v, True, "fa2", "none")
    ref = reference_attention(q.contiguous(), k.contiguous(), v.contiguous(), True, "fa2", "none")
    assert_matches_reference(out, ref, f"seed={seed}")


@pytest.mark.parametrize("fix", ["none", "fp32_output"])
def test_outputs_and_gradients_take_the_layout_of_the_inputs(seed, fix):
    """O, the FP32 O and dq/dk/dv are laid out like q/k/v (a model's (B, T, H, D) projections seen as (B, H, T, D)),
    so that the model's transpose of O and the projections' backward need no copy; dO may arrive in any layout
    with a unit last stride. Values are bit-identical to the same call on contiguous copies."""
    msg = f"seed={seed} fix={fix}"
    q, k, v, d_out = (torch.randn(2, 70, 4, 32).bfloat16().transpose(1, 2) for _ in range(4))
    k, v = k[:, :2], v[:, :2]  # grouped-query attention: 2 k/v heads
    d_out_other_layout = d_out.contiguous()  # dO in yet another layout than O
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    views = [t.contiguous().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, True, "fa2", fix)
    assert out.stride() == q.stride(), msg
    out.backward(d_out_other_layout)
    for name, leaf in zip("qkv", leaves):
        assert not leaf.is_contiguous() and leaf.grad.stride() == leaf.stride(), f"{msg}: d{name}"
    saved = saved_output(*(t.detach() for t in leaves), rounding="fa2", fix=fix, backend="triton")
    assert saved.stride() == q.stride(), msg
    ref_out = flash_attention(*views, True, "fa2", fix)
    assert ref_out.is_contiguous()
    ref_out.backward(d_out)
    assert torch.equal(out, ref_out), msg
    for name, a, b in zip("qkv", leaves, views):
        assert torch.equal(a.grad, b.grad), f"{msg}: d{name}"


SAFETY_CASES = [(0.0, 2), (0.0, 96), (1.0, 2), (120.0, 3), (1e4, 2), (1e30, 2), (-120.0, 2)]


def tied_inputs(logit: float, ties: int, seq: int = 96, dim: int = 64):
    """Rows whose maximum logit repeats ``ties`` times inside one key tile; V all ones (a correct O row is 1)."""
    q = torch.zeros(1, 1, seq, dim)
    k = torch.zeros(1, 1, seq, dim)
    q[..., 0] = 1.0
    k[..., 0] = (logit - abs(logit) / 4 - 1) * dim**0.5
    k[:, :, torch.arange(ties), 0] = logit * dim**0.5
    return q.bfloat16(), k.bfloat16(), torch.ones(1, 1, seq, dim, dtype=torch.bfloat16)


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
@pytest.mark.parametrize("logit,ties", SAFETY_CASES)
def test_safe_fix_never_nan_inf_or_zeroed(rounding, logit, ties):
    q, k, v = tied_inputs(logit, ties)
    out = flash_attention(q, k, v, False, rounding, "dynamic_max")
    assert torch.isfinite(out).all() and ((out.float() - 1).abs() <= 2**-6).all()


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_published_rule_failure_reproduced(rounding):
    """Every P_bar underflows; the authors' clamp of the row sum at 1e-10 zeroes the rows (NaN without it)."""
    q, k, v = tied_inputs(120.0, 2)
    out = flash_attention(q, k, v, False, rounding, "dynamic_max_published")
    assert (out == 0).all(), "a repeated logit of 120 with beta 2 underflows every P_bar: zeroed rows"
    out = flash_attention(*tied_inputs(20.0, 2), False, rounding, "dynamic_max_published", beta=7.0)
    assert (out == 0).all(), "beta 7 fails from a repeated logit of ~15"


@pytest.mark.parametrize("head_offset,total_heads", [(0, 0), (1, 3)], ids=["unsharded", "heads-1-2-of-3"])
def test_torch_compile_sees_a_custom_op(seed, head_offset, total_heads):
    """Compiled (custom op, fake kernels, register_autograd) and eager calls agree; with a global head index on
    tied inputs, so an offset lost on the compiled path would change the gradients."""
    if total_heads:
        q, k, v = (t.requires_grad_() for t in tied_maxima_inputs(1, 2, 2, 64)[:3])
    else:
        q, k, v = (torch.randn(1, 2, 64, 64).bfloat16().requires_grad_() for _ in range(3))

    def step(q, k, v):
        return flash_attention(q, k, v, True, "paper", "dynamic_max", head_offset=head_offset,
                                       total_heads=total_heads).float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    step(q, k, v).backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_clear_errors():
    q = torch.randn(1, 2, 8, 64).bfloat16()
    with pytest.raises(TypeError, match="dtype"):
        flash_attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="fix"):
        flash_attention(q, q, q, fix="dynamic")
    with pytest.raises(ValueError, match="exceeds total_heads=3"):
        flash_attention(q, q, q, head_offset=2, total_heads=3)
    with pytest.raises(ValueError, match="head_offset=-1 must be >= 0"):
        saved_output(q, q, q, head_offset=-1, total_heads=3, backend="triton")
    with pytest.raises(ValueError, match="total_heads=-1 must be >= 0"):
        fields = list(op_fields())
        fields[ops.FIELDS.index("total_heads")] = -1
        ops.flash_fwd(q, q, q, None, "triton", *fields)
    with pytest.raises(TypeError, match="autotune='no' must be True"):
        flash_attention(q, q, q, autotune="no")
    with pytest.raises(TypeError, match="out_fill='nan' must be None"):
        kernels.flash_attention(q, q, q, out_fill="nan")


def test_out_fill_shows_an_element_that_no_launch_writes(seed):
    """What the NaN-filled buffers of these tests catch: a forward launched one query tile short leaves the rows of
    that tile NaN in O and LSE. With every program launched the fill changes no bit of O or of the gradients."""
    q, k, v, d_out = (torch.randn(1, 2, 100, 64).bfloat16() for _ in range(4))
    settings = AttentionSettings(backend="triton", out_fill=NAN)
    nm = triton_flash.prepare(q, k, v, settings)
    launch, out, lse, _, _ = triton_flash._forward_launch(q, k, v, settings, nm)
    grid = launch.grid
    launch.grid = lambda cfg: (grid(cfg)[0] - 1, grid(cfg)[1])  # programs run heaviest tile first: rows 64-99 skipped
    launch()
    assert out[:, :, :BLOCK_N].isfinite().all() and lse[:, :, :BLOCK_N].isfinite().all()
    assert out[:, :, BLOCK_N:].isnan().all() and lse[:, :, BLOCK_N:].isnan().all()
    results = []
    for fill in (None, NAN):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = kernels.flash_attention(*leaves, out_fill=fill)
        o.backward(d_out)
        results.append([o.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("O", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"seed={seed}: out_fill changed {name}"


@pytest.mark.parametrize("rounding,fix,head_offset,total_heads",
                         [("fa2", "none", 0, 0), ("paper", "fp32_output", 0, 0), ("fa2", "dynamic_max", 1, 4)])
def test_eager_path_equals_custom_op(seed, rounding, fix, head_offset, total_heads):
    """Eager calls bypass the custom ops (host overhead); both must run the same launches with the same saved O
    (and the same global head index)."""
    q, k, v, d_out = (torch.randn(1, 2, 80, 32).bfloat16() for _ in range(4))
    if fix == "dynamic_max":
        q, k, v, d_out = tied_maxima_inputs(1, 2, 2, 80, dim=32)
    heads = dict(head_offset=head_offset, total_heads=total_heads)
    results = []
    for call in (lambda a, b, c: flash_attention(a, b, c, True, rounding, fix, **heads),
                 lambda a, b, c: fwd_op(a, b, c, rounding=rounding, fix=fix, out_fill=NAN, **heads)[0]):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = call(qq, kk, vv)
        out.backward(d_out)
        results.append([out.detach(), qq.grad, kk.grad, vv.grad])
    for name, a, b in zip(("O", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"seed={seed}: {name} of the eager path differs from the custom op's"


@pytest.mark.parametrize("rounding,fix", [("fa2", "none"), ("paper", "fp32_output")])
def test_fake_kernels_match_the_real_ops_on_model_layout_inputs(seed, rounding, fix):
    """torch.library.opcheck: the fake (meta) kernels that torch.compile traces with give the real ops' shapes,
    dtypes AND strides, for q, k, v as the model makes them: (B, T, H, D) projections viewed as (B, H, T, D), not
    contiguous. (A fake that copied q's strides for dq made compiled training fail in the backward.)"""
    q, k, v, d_out = (torch.randn(1, 48, 2, 32).bfloat16().transpose(1, 2) for _ in range(4))
    assert not q.is_contiguous()
    tests = ("test_schema", "test_faketensor")
    fields = op_fields(rounding=rounding, fix=fix, paper_block_keys=64)  # (the paper tile is ignored by fa2)
    args = (q, k, v, None, "triton", *fields)
    torch.library.opcheck(ops.flash_fwd, args, test_utils=tests)
    out, lse, o32, _ = ops.flash_fwd(*args)
    o_saved = o32 if fix == "fp32_output" else out
    torch.library.opcheck(ops.flash_bwd, (d_out, q, k, v, o_saved, lse, None, None, "triton", *fields),
                          test_utils=tests)


@pytest.mark.parametrize("fix", ["none", "dynamic_max", "fp32_output"])
def test_compiled_model_with_the_kernel_matches_eager(seed, fix):
    """The GPT with the kernel compiles as one graph (fullgraph: no graph break inside the model), and its loss and
    gradients equal the eager model's; the kernel sees the model's non-contiguous q, k, v views."""
    from model import GPT, GPTConfig
    from model.attention import KernelAttention

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=32, n_layer=2, n_head=2, d_model=64))
    model.set_attention(KernelAttention(AttentionSettings(backend="triton", fix=fix, out_fill=NAN), False))
    x, y = torch.randint(0, 64, (2, 32)), torch.randint(0, 64, (2, 32))

    def loss_and_grads(forward):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(x, y)[1]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager = loss_and_grads(model)
    compiled = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert torch.equal(eager[0], compiled[0])
    assert all(torch.equal(a, b) for a, b in zip(eager[1], compiled[1]))


# --------------------------------------------------------------------------------------------------------------
# Noise keys: fix=stochastic_output and the delta-error stress (delta_gain / delta_sign)
# --------------------------------------------------------------------------------------------------------------


def _keys(batch, seed, first_row=0):
    from kernels.rounding import layer_keys, row_keys

    return layer_keys(row_keys(seed, 3, torch.arange(first_row, first_row + batch)), 1)


def test_noise_hashes_in_kernel_match_reference_bitwise(seed):
    """_row_hash, _sr_bf16 and the random sign (uint32 on device) equal kernels.rounding's int64-masked versions,
    on keys over the whole 32-bit range and values with NaN, infinities, zeros, subnormals and the largest bf16."""
    import triton
    import triton.language as tl

    from kernels.rounding import mix32, noise_row_hash, sr_bf16, sr_bits

    @triton.jit
    def _hash_kernel(KEYS, HEADS, ROWS, X, Y, S, N, D: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        key = tl.load(KEYS + offs, mask=ok, other=0).to(tl.uint32)
        rows = tl.load(ROWS + offs, mask=ok, other=0)
        head = tl.load(HEADS + offs, mask=ok, other=0)
        rh = triton_flash._row_hash(key, head, rows)
        cols = tl.arange(0, D)
        x = tl.load(X + offs[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
        tl.store(Y + offs[:, None] * D + cols[None, :], triton_flash._sr_bf16(x, rh, cols), mask=ok[:, None])
        tl.store(S + offs, (triton_flash._mix32(rh ^ 0x68E31DA4) >> 31).to(tl.int32), mask=ok)

    n, d = 2048, 16
    keys = torch.randint(0, 2**32, (n,), dtype=torch.int64)
    keys[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    heads = torch.randint(0, 1 << 10, (n,), dtype=torch.int32)
    rows = torch.randint(0, 1 << 20, (n,), dtype=torch.int32)
    x = torch.randn(n, d) * torch.exp2(torch.randint(-140, 127, (n, d)).float())
    x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.3895314e38, -1e-45, 1e-40])
    y = torch.full_like(x, 7.0)
    s = torch.full((n,), -1, dtype=torch.int32)
    _hash_kernel[(triton.cdiv(n, 256),)](keys, heads, rows, x, y, s, n, D=d, BLOCK=256)
    rh = noise_row_hash(keys, heads, rows)
    expected = sr_bf16(x, sr_bits(rh.unsqueeze(-1), torch.arange(d)))
    assert torch.equal(y.view(torch.int32)[1:], expected.view(torch.int32)[1:]), f"seed={seed}"
    assert torch.isnan(y[0, 0]) and torch.equal(y[0, 1:], expected[0, 1:])
    assert torch.equal(s.long(), mix32(rh ^ 0x68E31DA4) >> 31), f"seed={seed}"


NOISE_CASES = [("stochastic_output", {}), ("none", dict(delta_gain=4.0, delta_sign="random")),
               ("stochastic_output", dict(delta_gain=0.0))]


@pytest.mark.parametrize("fix,extra", NOISE_CASES, ids=["sr", "gain4-random", "sr-gain0"])
@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_noise_modes_bit_for_bit_where_sums_are_exact(rounding, fix, extra, seed):
    """Kernel = reference bit for bit in O, LSE and the saved (effective) O on exact-arithmetic inputs."""
    from kernels.modes import check_args
    from kernels.reference import forward_core

    seq = int(torch.randint(65, 131, (1,)))
    q, k, v = exact_arithmetic_inputs(seq, True)
    kw = dict(extra, noise_keys=_keys(1, seed))
    out, lse, o32, _ = fwd_op(q, k, v, kw["noise_keys"], rounding=rounding, fix=fix, out_fill=NAN, **extra)
    nm = check_args(q, k, v, AttentionSettings(rounding=rounding, fix=fix, **extra), (torch.bfloat16,),
                    kw["noise_keys"])
    ref_out, ref_lse, ref_o32 = forward_core(q, k, v, True, nm, BLOCK_N, noise_keys=kw["noise_keys"])
    msg = f"seed={seed} seq={seq}"
    assert torch.equal(out.view(torch.int16), ref_out.view(torch.int16)), msg
    assert torch.equal(lse, ref_lse), msg
    assert (o32.numel() > 0) == nm.amplified == (ref_o32 is not None), msg
    if nm.amplified:
        assert torch.equal(o32, ref_o32), msg
    saved = saved_output(q, k, v, rounding=rounding, fix=fix, backend="triton", **kw)
    assert torch.equal(saved, saved_output(q, k, v, rounding=rounding, fix=fix, **kw)), msg


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_noise_modes_match_reference_with_gqa(rounding, seed):
    """Random inputs, grouped-query heads, a global head offset: O as the existing comparisons (nearly all bits),
    gradients within 2e-3 of the reference (random signs at gain 8 would be far off if a sign differed)."""
    q = torch.randn(2, 4, 70, 32).bfloat16()
    k, v = (torch.randn(2, 2, 70, 32).bfloat16() for _ in range(2))
    d_out = torch.randn(2, 4, 70, 32).bfloat16()
    kw = dict(causal=True, rounding=rounding, fix="stochastic_output", delta_gain=8.0, delta_sign="random",
              noise_keys=_keys(2, seed), head_offset=2, total_heads=6)
    results = []
    for fn in (flash_attention, reference_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        out.backward(d_out)
        results.append((out.detach(), [t.grad for t in leaves]))
    (out, grads), (ref_out, ref_grads) = results
    assert_matches_reference(out, ref_out, f"seed={seed}")
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert rel_err(g, rg) < 2e-3, f"seed={seed}: d{name} differs from the reference"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_gain_one_is_the_mode_and_gain_zero_the_fp32_output_delta_in_kernel(rounding, seed):
    """Gain 1 kept: the mode's launches (no FP32 O stored) and bits; gain 0 (fix=none): fp32_output's gradients
    bit for bit (the amplified delta launch adds gain * 0 to the same FP32 delta_fp32)."""
    q, k, v, d_out = (torch.randn(1, 2, 80, 32).bfloat16() for _ in range(4))

    def run(**kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, True, rounding, kw.pop("fix", "none"), **kw)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in leaves]

    base = run()
    assert all(torch.equal(a, b) for a, b in zip(base, run(delta_gain=1.0, delta_sign="kept",
                                                           noise_keys=_keys(1, seed))))
    assert fwd_op(q, k, v, rounding=rounding)[2].numel() == 0
    zero, fp32 = run(delta_gain=0.0), run(fix="fp32_output")
    assert torch.equal(zero[0], base[0])
    for name, a, b in zip("qkv", zero[1:], fp32[1:]):
        assert torch.equal(a, b), f"seed={seed}: d{name}"


def test_noise_modes_follow_the_global_head_in_kernel(seed):
    """Head slices with head_offset / total_heads give the whole call's bits (SR and random signs hash the global
    head); without the offset the slice's O differs."""
    q, k, v, d_out = tied_maxima_inputs(1, 4, 2, 64, dim=32)
    assert_head_slices_match_whole(flash_attention, q, k, v, d_out, parts=2, msg=f"seed={seed}",
                                   causal=True, rounding="fa2", fix="stochastic_output", delta_gain=8.0,
                                   delta_sign="random", noise_keys=_keys(1, seed))


def test_torch_compile_with_noise_arguments(seed):
    """Compiled (custom ops with noise_keys, o32 and the gain arguments; fake kernels) equals eager, bit for bit."""
    q, k, v = (torch.randn(2, 2, 64, 32).bfloat16().requires_grad_() for _ in range(3))
    keys = _keys(2, seed)

    def step(q, k, v, keys):
        return flash_attention(q, k, v, True, "paper", "stochastic_output", head_offset=1, total_heads=3,
                                       delta_gain=6.0, delta_sign="random", noise_keys=keys).float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v, keys)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = step(q, k, v, keys)
    eager.backward()
    assert torch.equal(loss, eager)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_fake_kernels_with_noise_arguments():
    q, k, v, d_out = (torch.randn(2, 48, 2, 32).bfloat16().transpose(1, 2) for _ in range(4))
    keys = _keys(2, 0)
    tests = ("test_schema", "test_faketensor")
    fields = op_fields(fix="stochastic_output", paper_block_keys=64, delta_gain=3.0, delta_sign="random")
    args = (q, k, v, keys, "triton", *fields)
    torch.library.opcheck(ops.flash_fwd, args, test_utils=tests)
    out, lse, o32, _ = ops.flash_fwd(*args)
    assert o32.shape == q.shape and o32.stride() == out.stride()
    torch.library.opcheck(ops.flash_bwd, (d_out, q, k, v, out, lse, o32, keys, "triton", *fields), test_utils=tests)


def test_stochastic_output_refuses_fp16_in_kernel():
    q = torch.randn(1, 2, 8, 32).half()
    with pytest.raises(ValueError, match="use bf16"):
        flash_attention(q, q, q, fix="stochastic_output")


# --------------------------------------------------------------------------------------------------------------
# fix=exact_delta, delta_reference=exact (issue 34; the reference's side: test_attention_exact_delta.py)
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_exact_delta_in_kernel_is_the_fp64_rowsum_within_its_bound(rounding, seed):
    """The kernel's exact pass (a launch of its own) against FP64 rowsum(P * dP) / rowsum(P) of the backward's P:
    within gamma(2n + D + 4) T / rowsum(P), the reference's bound (test_attention_exact_delta.py) plus 4 ulps for
    P's exp2, which numpy evaluates in the kernel and torch here (each within an ulp or two of exact). GQA heads."""
    from tests.unit.test_attention_exact_delta import fp64_rowsum_p_dp, gamma

    q, k, v, d_out = tied_maxima_inputs(1, 2, 1, 130)
    settings = AttentionSettings(backend="triton", rounding=rounding, fix="exact_delta", out_fill=NAN)
    nm = triton_flash.prepare(q, k, v, settings)
    out, lse, _, _ = triton_flash.forward(q, k, v, settings, nm)
    launches, _ = triton_flash._backward_launches(d_out, q, k, v, out, lse, settings, nm)
    exact_launch = launches[0]
    assert exact_launch.kernel is triton_flash.DELTA_EXACT and len(launches) == 3  # no rowsum(dO * O) launch
    exact_launch()
    delta = exact_launch.tensors[-1]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    delta64, size = fp64_rowsum_p_dp(q, kk, vv, d_out, lse, True, nm)
    err = (delta.double() - delta64).abs()
    assert (err <= gamma(2 * 130 + 64 + 4) * size).all(), f"seed={seed}: worst {(err / size).max().item():.2e}"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_exact_reference_in_kernel(rounding, seed):
    """delta_reference=exact in the kernel: gain 0 gives exact_delta's gradients bit for bit (the gain launch adds
    gain * 0 to the exact pass's delta); gain 5 with random signs on fp32_output (whose delta now has an error to
    amplify) matches the reference."""
    q, k, v, d_out = tied_maxima_inputs(1, 2, 2, 80, dim=32)
    keys = _keys(1, seed)

    def run(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, True, rounding, noise_keys=keys, **kw)
        out.backward(d_out)
        return [out.detach()] + [t.grad for t in leaves]

    exact = run(flash_attention, fix="exact_delta")
    zero = run(flash_attention, fix="none", delta_gain=0.0, delta_reference="exact")
    assert all(same_bits(a, b) for a, b in zip(exact, zero)), f"seed={seed}"
    kw = dict(fix="fp32_output", delta_gain=5.0, delta_sign="random", delta_reference="exact")
    for name, g, rg in zip("Oqkv", run(flash_attention, **kw), run(reference_attention, **kw)):
        assert rel_err(g, rg) < 2e-3, f"seed={seed}: {name} differs from the reference"


@pytest.mark.parametrize("rounding", kernels.ROUNDINGS)
def test_v_one_in_kernel(rounding, seed):
    """V = 1 in the kernel: O within the mode's bound of 1, and exact_delta's dQ and dK ~0 (the exact softmax's are
    0) where fp32_output's are not (its O32 = sum LP(P) / sum P; test_attention_exact_delta.py)."""
    from tests.unit.test_attention_exact_delta import O_BOUND, v_one_inputs

    q, k, v, d_out = v_one_inputs()
    grads = {}
    for fix in ("fp32_output", "exact_delta"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, True, rounding, fix)
        assert ((out.float() - 1).abs() <= O_BOUND[rounding]).all(), f"seed={seed}: {fix}"
        out.backward(d_out)
        grads[fix] = [t.grad.double() for t in leaves]
    for name, i in (("dq", 0), ("dk", 1)):
        rms = {fix: g[i].square().mean().sqrt().item() for fix, g in grads.items()}
        assert rms["exact_delta"] < 2.0**-8 * rms["fp32_output"], f"seed={seed}: {name} {rms}"


@pytest.mark.parametrize("rounding,fix", [("fa2", "none"), ("paper", "stochastic_output")])
def test_output_gain_in_kernel(rounding, fix, seed):
    """output_gain in the kernel's epilogue: O matches the reference's LP(O_fp32 + g * s * (O_mode - O_fp32)), the
    mode's own O is kept for delta (the gradients for the same dO are the kernel's without the stress, bit for
    bit), and gain 1 kept is the mode's launch (no second O kept)."""
    q, k, v, d_out = tied_maxima_inputs(1, 2, 2, 80, dim=32)
    keys = _keys(1, seed)
    kw = dict(causal=True, rounding=rounding, fix=fix, noise_keys=keys)
    stress = dict(output_gain=8.0, output_sign="random")
    (out, grads), (ref_out, _) = [out_and_grads(fn, q, k, v, d_out, **kw, **stress)
                                  for fn in (flash_attention, reference_attention)]
    assert_matches_reference(out, ref_out, f"seed={seed}")
    _, mode_grads = out_and_grads(flash_attention, q, k, v, d_out, **kw)
    assert all(same_bits(a, b) for a, b in zip(grads, mode_grads)), f"seed={seed}: the backward changed"
    assert fwd_op(q, k, v, keys, rounding=rounding, fix=fix)[3].numel() == 0
    assert fwd_op(q, k, v, keys, rounding=rounding, fix=fix, **stress)[3].shape == q.shape
