"""How the Gluon forward writes O and the FP32 O (kernels.gluon_flash._fwd_store_plan): through shared-memory
buffers and TMA stores where the buffers fit beside Q's slots and the K/V ring, the bf16 O first. Host arithmetic,
no GPU; it runs in a fresh interpreter because Gluon cannot be imported into a process whose Triton was first
imported under TRITON_INTERPRET=1 (the unit tier's Triton-interpreter tests)."""

import pytest

from tests.runs import fresh_python_json

PLANS = """
import json
from kernels import gluon_flash as gf
plans = {f"{d} {slots} {o32} {want}": gf._fwd_store_plan(o32, d, slots, o_tma_wanted=want)
         for d in (64, 128) for slots in (1, 2) for o32 in (False, True) for want in (False, True)}
print(json.dumps(dict(plans=plans, block_m=gf.FWD_BLOCK_M, block_n=gf.FWD_BLOCK_N, stages=gf.FWD_STAGES,
                      budget=gf.SHARED_MEMORY_BYTES, o32_tma=gf.FWD_O32_TMA)))
"""


@pytest.fixture(scope="module")
def plan():
    pytest.importorskip("triton")
    return fresh_python_json(PLANS)


def shared_bytes(p, head_dim: int, q_slots: int, o_tma: bool, o32_tma: bool) -> int:
    """What the forward kernel allocates for that plan (``_fwd_kernel``): Q per slot and consumer, K and V per
    stage, one bf16 O and one FP32 O buffer per consumer where they go by TMA, 1 KiB of barriers."""
    half, d = p["block_m"] // 2, head_dim
    total = 2 * q_slots * half * d * 2 + p["stages"][str(d)] * 2 * p["block_n"] * d * 2
    return total + o_tma * 2 * half * d * 2 + o32_tma * 2 * half * d * 4 + 1024


def test_the_planned_buffers_fit_and_none_that_would_fit_is_left_out(plan):
    for key, (o_tma, o32_tma) in plan["plans"].items():
        d, slots, o32, want = int(key.split()[0]), int(key.split()[1]), key.split()[2] == "True", key.split()[3] == "True"
        assert shared_bytes(plan, d, slots, o_tma, o32_tma) <= plan["budget"], key
        assert o_tma == want, f"{key}: the bf16 O's buffers fit in every configuration the kernel launches"
        if not o32:
            assert not o32_tma, key
        elif plan["o32_tma"] and not o32_tma:
            assert shared_bytes(plan, d, slots, o_tma, True) > plan["budget"], key


def test_head_dim_128_with_the_fp32_o_keeps_one_of_the_two_by_tma(plan):
    # 32 KiB of Q, 128 KiB of K/V ring: the bf16 O's 32 KiB fit, the FP32 O's 64 KiB do not fit beside them
    assert plan["plans"]["128 1 True True"] == [True, False]
    assert plan["plans"]["128 1 True False"] == [False, plan["o32_tma"]]
    assert plan["plans"]["64 1 True True"] == [True, plan["o32_tma"]]
