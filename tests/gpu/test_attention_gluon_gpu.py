"""The Gluon Hopper kernel (kernels/gluon_flash.py) on an sm_90 GPU: every mode it takes against the reference and
fp64, forward and backward, ragged tails, grouped-query heads, both dQ orders, eager and compiled, the fallback to
the Triton kernel, and backend=auto's choice.

Run on an H100/H200: ``python -m pytest tests/gpu/test_attention_gluon_gpu.py``. Skipped without a Hopper GPU.

Tolerances follow from the summation order. The forward sums 128-key tiles, so it is compared with the reference at
block_n=128 (the same tiles: only the MMA's internal order and the GPU's approximate exp2 differ, as for the Triton
kernel at 64, tests/gpu/test_attention_gpu.py); the backward adds dQ's shares per 128-key tile in an FP32 buffer
(the reference and the Triton kernel sum them inside one accumulator), so its gradients are held to the Triton
kernel's error against fp64, not to its bits.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs a Hopper (sm_90) GPU")]

import kernels  # noqa: E402
from kernels.modes import GLUON_FIXES, AttentionSettings  # noqa: E402
from tests.attention_common import NAN, fp64_out_and_grads, rel_err  # noqa: E402


def gluon(q, k, v, causal=True, fix="none", deterministic=True, **named):
    settings = AttentionSettings(causal=causal, fix=fix, backend="gluon", deterministic=deterministic,
                                 out_fill=NAN, **named)
    return kernels.attention(q, k, v, settings)


def model_layout(batch, heads, kv_heads, seq, dim, dtype=torch.bfloat16):
    """q, k, v as the model makes them: (B, T, H, D) projections seen as (B, H, T, D); dO contiguous."""
    q = torch.randn(batch, seq, heads, dim, device="cuda").to(dtype).transpose(1, 2)
    k, v = (torch.randn(batch, seq, kv_heads, dim, device="cuda").to(dtype).transpose(1, 2) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, dim, device="cuda").to(dtype)


def out_and_grads(fn, q, k, v, d_out, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]


def grads_per_switch(monkeypatch, switch, q, k, v, d_out, **kw):
    """The Gluon gradients with kernels.gluon_flash's ``switch`` off, then on."""
    from kernels import gluon_flash

    runs = []
    for on in (False, True):
        monkeypatch.setattr(gluon_flash, switch, on)
        runs.append(out_and_grads(gluon, q, k, v, d_out, **kw)[1])
    return runs


CASES = ([(fix, torch.bfloat16, True, d) for fix in GLUON_FIXES for d in (64, 128)]
         + [("none", torch.float16, True, 64), ("fp32_output", torch.bfloat16, False, 128)])


@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered-dQ", "atomic-dQ"])
@pytest.mark.parametrize("fix,dtype,causal,head_dim", CASES,
                         ids=[f"{f}-{str(t)[6:]}-{'causal' if c else 'full'}-d{d}" for f, t, c, d in CASES])
def test_gluon_matches_reference_and_fp64(fix, dtype, causal, head_dim, deterministic, seed):
    seq = int(torch.randint(130, 700, (1,)))  # ragged: rarely a multiple of the 128-row and -key tiles
    q, k, v, d_out = model_layout(2, 4, 2, seq, head_dim, dtype)  # 2 q heads per k/v head
    msg = f"seed={seed} seq={seq}"
    out, grads = out_and_grads(gluon, q, k, v, d_out, causal=causal, fix=fix, deterministic=deterministic)
    assert out.dtype == dtype and torch.isfinite(out).all(), msg
    assert all(torch.isfinite(g).all() for g in grads), f"{msg}: a gradient element no launch wrote"
    ref = kernels.reference_attention(q, k, v, causal, "fa2", fix, block_n=128)
    assert (out != ref).float().mean() < 0.05, f"{msg}: too many elements differ from the reference"
    assert rel_err(out, ref) < torch.finfo(dtype).eps / 2, msg
    t_out, t_grads = out_and_grads(kernels.flash_attention, q, k, v, d_out, causal=causal, fix=fix, autotune=False)
    exact_out, exact_grads = fp64_out_and_grads(q, k, v, d_out, causal)
    assert rel_err(out, exact_out) < 1.1 * rel_err(t_out, exact_out) + 1e-5, msg
    for name, g, tg, eg in zip("qkv", grads, t_grads, exact_grads):
        assert rel_err(g, eg) < 1.1 * rel_err(tg, eg) + 1e-5, f"{msg}: d{name}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_ordered_dq_is_bit_reproducible_and_atomics_agree(head_dim, seed):
    """deterministic=true: dQ's shares added in a fixed order (a counter per query tile), the same bits every run;
    the atomic order's dQ is the same FP32 sum in another order (nearly every element equal), dK and dV identical."""
    q, k, v, d_out = model_layout(2, 4, 4, 1000, head_dim)
    first = out_and_grads(gluon, q, k, v, d_out)[1]
    again = out_and_grads(gluon, q, k, v, d_out)[1]
    assert all(torch.equal(a, b) for a, b in zip(first, again)), f"seed={seed}"
    atomic = out_and_grads(gluon, q, k, v, d_out, deterministic=False)[1]
    assert torch.equal(atomic[1], first[1]) and torch.equal(atomic[2], first[2]), f"seed={seed}: dk, dv"
    assert (atomic[0] != first[0]).float().mean() < 0.05, f"seed={seed}"
    assert rel_err(atomic[0], first[0]) < torch.finfo(torch.bfloat16).eps, f"seed={seed}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_is_the_same_under_every_tile_schedule(head_dim, monkeypatch, seed):
    """The persistent forward's schedule (which program runs which tile, in what order) changes no bit: the
    static share, the dynamic counter over every head, and sections of a few heads (the last one smaller) give
    the same O, LSE and FP32 O. More tiles than programs (so that the counter is used), ragged, grouped heads."""
    from kernels import gluon_flash

    q, k, v, _ = model_layout(3, 6, 2, 2048 + 37, head_dim)  # 17 query blocks x 18 heads = 306 tiles
    settings = AttentionSettings(backend="gluon", fix="fp32_output")
    nm = gluon_flash.prepare(q, k, v, settings)
    kv_bytes = 2 * q.shape[2] * head_dim * 2

    def run(dynamic, section_bytes):
        monkeypatch.setattr(gluon_flash, "FWD_DYNAMIC", dynamic)
        monkeypatch.setattr(gluon_flash, "FWD_L2_SECTION_BYTES", section_bytes)
        return gluon_flash.forward(q, k, v, settings, nm)[:3]

    static = run(False, 0)
    assert gluon_flash._programs(q.device, gluon_flash.FWD_PERSISTENT) < 306, "the counter would not be used"
    for dynamic, section_bytes in ((True, 0), (True, kv_bytes * 4 // 3), (False, kv_bytes * 4 // 3)):
        monkeypatch.setattr(gluon_flash, "FWD_L2_SECTION_BYTES", section_bytes)
        assert gluon_flash._heads_per_section(q, k) == (4 if section_bytes else 18)
        got = run(dynamic, section_bytes)
        assert all(torch.equal(a, b) for a, b in zip(got, static)), f"seed={seed} {dynamic} {section_bytes}"
    ref = kernels.reference_attention(q, k, v, True, "fa2", "fp32_output", block_n=128)
    assert rel_err(static[0], ref) < torch.finfo(torch.bfloat16).eps / 2, f"seed={seed}"



@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fix", ["none", "fp32_output", "stochastic_output"])
@pytest.mark.parametrize("switch", ["FWD_ROW_DIVIDE", "FWD_O_TMA"])
def test_epilogue_variants_give_the_bits_of_the_default(switch, head_dim, fix, monkeypatch, seed):
    """The forward's epilogue variants change no bit of O, LSE or the FP32 O against the plain epilogue
    (gl.div_rn per element, O by stores from registers): FWD_ROW_DIVIDE (O = acc / l with one reciprocal per row)
    and FWD_O_TMA (the bf16 O staged in shared memory and written by TMA). Ordinary values (the per-row path), V
    scaled by 2^-70 and by 2^66 (|acc| below 2^-64 in the first rows, above 2^64 in most elements: those tiles take
    gl.div_rn under FWD_ROW_DIVIDE), and a ragged tail (rows past T, which the TMA store must not write)."""
    from kernels import gluon_flash

    q, k, v, _ = model_layout(2, 4, 2, 1024 + 37, head_dim)
    settings = AttentionSettings(backend="gluon", fix=fix, out_fill=NAN)
    monkeypatch.setattr(gluon_flash, "FWD_ROW_DIVIDE", False)
    monkeypatch.setattr(gluon_flash, "FWD_O_TMA", False)
    for v_scale in (1.0, 2.0**-70, 2.0**66):
        v_scaled = (v.float() * v_scale).to(v.dtype)
        nm = gluon_flash.prepare(q, k, v_scaled, settings)
        outs = []
        for on in (False, True):
            monkeypatch.setattr(gluon_flash, switch, on)
            outs.append(gluon_flash.forward(q, k, v_scaled, settings, nm)[:3])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), f"seed={seed} V*{v_scale}"
        assert torch.isfinite(outs[1][0]).all(), f"seed={seed} V*{v_scale}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_lagging_consumer_gives_the_bits_of_the_default(head_dim, monkeypatch, seed):
    """FWD_LAG (consumer 1 starts its first tile after consumer 0's first softmax: a change of schedule only): O,
    LSE and the FP32 O bit for bit as without it, NaN-filled outputs; more tiles than programs (the tile counter,
    causal, fp32_output), full attention, and a few short tiles (a program per tile, one key tile each)."""
    from kernels import gluon_flash

    for seq, causal, fix in ((4096 + 37, True, "fp32_output"), (1024 + 37, False, "none"), (100, True, "none")):
        q, k, v, _ = model_layout(4, 8, 2, seq, head_dim)
        settings = AttentionSettings(backend="gluon", fix=fix, causal=causal, out_fill=NAN)
        nm = gluon_flash.prepare(q, k, v, settings)
        outs = []
        for on in (False, True):
            monkeypatch.setattr(gluon_flash, "FWD_LAG", on)
            outs.append(gluon_flash.forward(q, k, v, settings, nm)[:3])
        msg = f"seed={seed} seq={seq} causal={causal} {fix}"
        assert all(torch.equal(a, b) for a, b in zip(*outs)), msg
        assert torch.isfinite(outs[1][0]).all() and torch.isfinite(outs[1][1]).all(), msg


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_first_dq_share_stored_gives_the_gradients_of_adds_into_zeros(head_dim, causal, monkeypatch, seed):
    """BWD_DQ_FIRST_STORE (ordered dQ): the first key tile of each query tile stores its share into an unzeroed
    (here NaN-filled) FP32 buffer instead of adding it to zeros. Same dQ, dK, dV (torch.equal: 0 + x = x), every
    element written; grouped heads and a ragged length (rows past T)."""
    q, k, v, d_out = model_layout(2, 4, 2, 1024 + 36, head_dim)
    runs = grads_per_switch(monkeypatch, "BWD_DQ_FIRST_STORE", q, k, v, d_out, causal=causal, deterministic=True)
    msg = f"seed={seed} causal={causal}"
    assert all(torch.isfinite(g).all() for g in runs[1]), f"{msg}: a dQ element no share wrote"
    assert all(torch.equal(a, b) for a, b in zip(*runs)), msg


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_first_dq_share_stored_under_atomic_adds(head_dim, causal, monkeypatch, seed):
    """BWD_ATOMIC_FIRST_STORE (atomic dQ): the first key tile of each query tile in the ordered turn order stores
    its share into the unzeroed (here NaN-filled) buffer and raises a flag; the others add after it in any order.
    Every dQ element written; dQ the ordered dQ's FP32 sums in another order (as the plain atomic mode's), dK and dV
    identical; grouped heads and a ragged length."""
    from kernels import gluon_flash

    q, k, v, d_out = model_layout(2, 4, 2, 1024 + 36, head_dim)
    ordered = out_and_grads(gluon, q, k, v, d_out, causal=causal, deterministic=True)[1]
    monkeypatch.setattr(gluon_flash, "BWD_ATOMIC_FIRST_STORE", True)
    atomic = out_and_grads(gluon, q, k, v, d_out, causal=causal, deterministic=False)[1]
    msg = f"seed={seed} causal={causal}"
    assert torch.isfinite(atomic[0]).all(), f"{msg}: a dQ element no share wrote"
    assert torch.equal(atomic[1], ordered[1]) and torch.equal(atomic[2], ordered[2]), f"{msg}: dk, dv"
    assert (atomic[0] != ordered[0]).float().mean() < 0.05, msg
    assert rel_err(atomic[0], ordered[0]) < torch.finfo(torch.bfloat16).eps, msg


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered-dQ", "atomic-dQ"])
def test_dk_dv_by_tma_give_the_bits_of_plain_stores(head_dim, deterministic, monkeypatch, seed):
    """BWD_DKV_TMA: dK and dV staged in the dQ double buffer and written by TMA give the bits of plain stores
    (NaN-filled outputs: an element no copy writes shows; a ragged length: rows past T must not be written),
    grouped heads, causal and not; dQ unchanged."""
    q, k, v, d_out = model_layout(2, 4, 2, 1024 + 36, head_dim)
    for causal in (True, False):
        runs = grads_per_switch(monkeypatch, "BWD_DKV_TMA", q, k, v, d_out, causal=causal, deterministic=deterministic)
        msg = f"seed={seed} causal={causal}"
        assert all(torch.isfinite(g).all() for g in runs[1]), f"{msg}: an element no launch wrote"
        assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2]), f"{msg}: dk, dv"
        if deterministic:
            assert torch.equal(runs[0][0], runs[1][0]), f"{msg}: dq"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("deterministic", [True, False], ids=["ordered-dQ", "atomic-dQ-first-store"])
def test_dq_finished_by_its_last_add_gives_the_bits_of_the_finishing_launch(head_dim, deterministic, monkeypatch,
                                                                            seed):
    """BWD_DQ_FINISH: the key tile that adds last into a query tile loads the finished FP32 sums back and writes
    dQ = LP(scale * sums) itself, with the bits of the separate finishing launch. Ordered dQ: the last turn, the same
    bits; atomic dQ behind a stored first share (BWD_ATOMIC_FIRST_STORE): the tile whose add completes the count,
    dQ the same sums in another order. NaN-filled outputs (a dQ element nobody writes shows), dQ strided like the
    model's q, a ragged length (rows past T must not be written), grouped heads, causal and not, fp16, and a
    sequence of one key tile (whose only share is stored, then finished)."""
    from kernels import gluon_flash

    monkeypatch.setattr(gluon_flash, "BWD_ATOMIC_FIRST_STORE", True)  # (ordered dQ does not read it)
    for seq, causal, dtype in ((1024 + 36, True, torch.bfloat16), (1024 + 36, False, torch.bfloat16),
                               (700, True, torch.float16), (100, True, torch.bfloat16)):
        q, k, v, d_out = model_layout(2, 4, 2, seq, head_dim, dtype)
        runs = grads_per_switch(monkeypatch, "BWD_DQ_FINISH", q, k, v, d_out, causal=causal,
                                deterministic=deterministic)
        msg = f"seed={seed} seq={seq} causal={causal} {dtype}"
        assert all(torch.isfinite(g).all() for g in runs[1]), f"{msg}: an element no launch wrote"
        assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2]), f"{msg}: dk, dv"
        if deterministic:
            assert torch.equal(runs[0][0], runs[1][0]), f"{msg}: dq"
        else:
            assert (runs[0][0] != runs[1][0]).float().mean() < 0.05, msg
            assert rel_err(runs[1][0], runs[0][0]) < torch.finfo(dtype).eps, msg


def test_delta_stress_and_fp32_output_through_gluon(seed):
    """The delta-error stress runs on the Gluon backward (the delta launch is shared): gain 0 is fp32_output's
    delta, so its gradients are fp32_output's bit for bit; gain 1 with random signs is a finite run."""
    q, k, v, d_out = model_layout(1, 4, 4, 512, 128)
    fixed = out_and_grads(gluon, q, k, v, d_out, fix="fp32_output")[1]
    gain0 = out_and_grads(gluon, q, k, v, d_out, delta_gain=0.0)[1]
    assert all(torch.equal(a, b) for a, b in zip(fixed, gain0)), f"seed={seed}"
    keys = torch.arange(1, 2, device="cuda", dtype=torch.int64)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    settings = AttentionSettings(backend="gluon", delta_gain=5.0, delta_sign="random", out_fill=NAN)
    kernels.attention(*leaves, settings, keys).backward(d_out)
    assert all(torch.isfinite(t.grad).all() for t in leaves), f"seed={seed}"


def test_compiled_equals_eager():
    """torch.compile takes the custom-op route (kernels/ops.py) to the same launches: the same bits. 256 query
    tiles: more than an H100/H200 has programs, so the forward takes tiles from its counter."""
    q, k, v, d_out = model_layout(2, 8, 8, 2048, 128)
    settings = AttentionSettings(backend="gluon", fix="fp32_output")

    def step(q, k, v):
        return kernels.attention(q * 1.0, k, v, settings)

    eager, e_grads = out_and_grads(step, q, k, v, d_out)
    compiled, c_grads = out_and_grads(torch.compile(step, fullgraph=True), q, k, v, d_out)
    assert torch.equal(eager, compiled)
    assert all(torch.equal(a, b) for a, b in zip(e_grads, c_grads))


def test_saved_output_is_the_fp32_o_of_the_forward():
    """The delta-bias monitor's O (kernels.saved_output with the run's settings) is the forward's FP32 O."""
    q, k, v, _ = model_layout(1, 2, 2, 300, 128)
    settings = AttentionSettings(backend="gluon", fix="fp32_output")
    from kernels import gluon_flash

    nm = gluon_flash.prepare(q, k, v, settings)
    _, _, o32, _ = gluon_flash.forward(q, k, v, settings, nm)
    assert torch.equal(kernels.saved_output(q, k, v, settings), o32)


def test_calls_it_cannot_run_go_to_the_triton_kernel_and_say_so_once(capsys):
    q, k, v, _ = model_layout(1, 2, 2, 256, 32)  # head_dim 32: not one the Gluon kernel takes
    out = gluon(q, k, v)
    assert torch.equal(out, kernels.flash_attention(q, k, v, out_fill=NAN))
    gluon(q, k, v)
    said = capsys.readouterr().out
    assert said.count("the Triton kernel runs it") == 1 and "head_dim 32" in said, said


def test_auto_picks_gluon_where_it_is_the_faster_kernel():
    device = torch.device("cuda")
    auto = AttentionSettings()
    assert kernels.implementation(auto, device, 128) == "gluon"
    assert kernels.implementation(auto, device, 64) == "triton"
    assert kernels.implementation(AttentionSettings(fix="dynamic_max"), device, 128) == "triton"
    assert kernels.implementation(AttentionSettings(rounding="paper"), device, 128) == "triton"
