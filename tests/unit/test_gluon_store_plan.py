"""How the Gluon forward writes O and the FP32 O (kernels.gluon_flash._fwd_store_plan): through shared-memory
buffers and TMA stores where the buffers fit beside Q's slots and the K/V ring, the bf16 O first. Pure host code:
no GPU is touched."""

import pytest

pytest.importorskip("triton.experimental.gluon")

from kernels import gluon_flash as gf  # noqa: E402


def shared_bytes(head_dim: int, q_slots: int, o_tma: bool, o32_tma: bool) -> int:
    """What the forward kernel allocates for that plan (``_fwd_kernel``): Q per slot and consumer, K and V per
    stage, one bf16 O and one FP32 O buffer per consumer where they go by TMA."""
    half, d = gf.FWD_BLOCK_M // 2, head_dim
    total = 2 * q_slots * half * d * 2 + gf.FWD_STAGES[d] * 2 * gf.FWD_BLOCK_N * d * 2
    return total + o_tma * 2 * half * d * 2 + o32_tma * 2 * half * d * 4


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_slots", [1, 2])
@pytest.mark.parametrize("store_o32", [False, True])
def test_the_planned_buffers_fit_and_none_that_would_fit_is_left_out(head_dim, q_slots, store_o32):
    o_tma, o32_tma = gf._fwd_store_plan(store_o32, head_dim, q_slots, o_tma_wanted=True)
    assert shared_bytes(head_dim, q_slots, o_tma, o32_tma) + 1024 <= gf.SHARED_MEMORY_BYTES
    assert o_tma, "the bf16 O's buffers fit in every configuration the kernel launches"
    if store_o32 and not o32_tma:
        assert shared_bytes(head_dim, q_slots, True, True) + 1024 > gf.SHARED_MEMORY_BYTES
    if not store_o32:
        assert not o32_tma


def test_head_dim_128_with_the_fp32_o_keeps_one_of_the_two_by_tma():
    # 32 KiB of Q, 128 KiB of K/V ring: the bf16 O's 32 KiB fit, the FP32 O's 64 KiB do not fit beside them
    assert gf._fwd_store_plan(True, 128, 1, o_tma_wanted=True) == (True, False)
    assert gf._fwd_store_plan(True, 128, 1, o_tma_wanted=False) == (False, gf.FWD_O32_TMA)
    assert gf._fwd_store_plan(True, 64, 1, o_tma_wanted=True) == (True, gf.FWD_O32_TMA)
    assert gf._fwd_store_plan(False, 128, 1, o_tma_wanted=False) == (False, False)
