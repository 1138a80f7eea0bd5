"""What the Gluon kernels' launches are given (kernels.gluon_flash._fwd_launch, _bwd_launch: the host side that the GPU
calls and kernels.offline_compile share): grids, buffers and how they start, counters, descriptors, options. Host
code on CPU tensors, no GPU; it runs in a fresh interpreter because Gluon cannot be imported into a process whose
Triton was first imported under TRITON_INTERPRET=1 (the unit tier's Triton-interpreter tests)."""

import pytest

from tests.runs import fresh_python_json

LAUNCHES = r"""
import json, math
import torch
from kernels import gluon_flash as gf, triton_flash
from kernels.modes import AttentionSettings
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

def kind(x):
    if isinstance(x, TensorDescriptor):
        return ["descriptor", list(x.block_shape)]
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape)]
    return ["scalar", x]

b, h, hk, t = 2, 4, 2, 1000  # grouped heads, a length that is no multiple of the tiles
out = {"bwd": {}, "fwd": {}}
for d in (64, 128):
    q = torch.empty(b, t, h, d, dtype=torch.bfloat16).transpose(1, 2)  # the model's layout
    k, v = (torch.empty(b, t, hk, d, dtype=torch.bfloat16).transpose(1, 2) for _ in range(2))
    d_out = torch.empty(b, h, t, d, dtype=torch.bfloat16)
    nm = AttentionSettings().numerics(d, torch.bfloat16)
    lse, delta = torch.empty(b, h, t), torch.empty(b, h, t)
    dq, dk, dv = triton_flash._backward_outputs(q, k, v)
    for det, choices in ((True, {}), (False, {}), (True, dict(first_store=False)), (False, dict(finish=True)),
                         (False, dict(first_store=True, finish=True)), (True, dict(finish=True, dkv_tma=True))):
        grid, args, options, dq32 = gf._bwd_launch(d_out, q, k, v, lse, delta, dq, dk, dv, True, nm, det,
                                                   fill=float("nan"), **choices)
        key = f"{d} {det} {sorted(choices.items())}"
        out["bwd"][key] = dict(grid=list(grid), options={n: options[n] for n in ("FIRST_STORE", "FINISH", "DKV_TMA",
                                                                               "DETERMINISTIC", "CAUSAL")},
                               dq32_nan=bool(torch.isnan(dq32).all()), dq32_zero=bool((dq32 == 0).all()),
                               sem=[args[7].numel(), int(args[7].abs().sum())], dkv=[kind(args[8]), kind(args[9])],
                               dq_is_dq=args[10] is dq, dq_strides=list(args[17:20]), dq_stride=list(dq.stride()[:3]),
                               tail=list(args[20:23]), n_args=len(args), dq32_desc=kind(args[6]))
    for fix in ("none", "fp32_output"):
        fnm = AttentionSettings(fix=fix).numerics(d, torch.bfloat16)
        o, lse_f, o32 = triton_flash._forward_outputs(q, fnm.keeps_fp32_output)
        keys = triton_flash._keys_arg(fnm, None, b, q.device)
        for programs in (16, 10**6):
            grid, args, options = gf._fwd_launch(q, k, v, o, lse_f, o32, keys, True, fnm, programs=programs)
            out["fwd"][f"{d} {fix} {programs}"] = dict(
                grid=list(grid), dynamic=options["DYNAMIC"], counter=kind(args[7]), o=kind(args[3]),
                o32=kind(args[4]), o_tma=options["O_TMA"], o32_tma=options["O32_TMA"],
                plan=list(gf._fwd_store_plan(fnm.keeps_fp32_output, d, gf.FWD_Q_SLOTS)), group=args[12])
try:
    gf._fwd_launch(q, k, v, o, lse_f, o32, keys, True, fnm, programs=16, Q_SLOT=2)
    out["unknown_choice"] = "accepted"
except ValueError as exc:
    out["unknown_choice"] = str(exc)
out["defaults"] = dict(first_store=gf.BWD_DQ_FIRST_STORE, atomic_first_store=gf.BWD_ATOMIC_FIRST_STORE,
                       finish=gf.BWD_DQ_FINISH, dkv_tma=gf.BWD_DKV_TMA, block_m=gf.BWD_BLOCK_M[64],
                       fwd_block_m=gf.FWD_BLOCK_M)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def launches():
    pytest.importorskip("triton")
    return fresh_python_json(LAUNCHES)


def test_backward_buffers_and_counters_follow_the_options(launches):
    b, h, hk, t = 2, 4, 2, 1000
    defaults = launches["defaults"]
    for d in (64, 128):
        rows = {key: row for key, row in launches["bwd"].items() if key.startswith(f"{d} ")}
        for key, row in rows.items():
            opts = row["options"]
            assert row["grid"] == [-(-t // 128), b * hk], key  # a CTA per key tile of each k/v head
            assert row["tail"] == [h, h // hk, t], key  # heads, query heads per k/v head, length
            assert row["dq_is_dq"] and row["dq_strides"] == row["dq_stride"], key  # dQ itself, strided like q
            assert row["dq32_desc"] == ["descriptor", [1, 1, defaults["block_m"], d]], key
            # a stored first share writes the whole FP32 buffer, so it is not zeroed (here: left NaN-filled);
            # otherwise the shares are added into zeros
            assert row["dq32_nan"] == opts["FIRST_STORE"] and row["dq32_zero"] == (not opts["FIRST_STORE"]), key
            # a counter per query tile (zeroed) where tiles take turns or wait for a first share
            counted = opts["DETERMINISTIC"] or opts["FIRST_STORE"]
            assert row["sem"] == [b * h * -(-t // defaults["block_m"]) if counted else 1, 0], key
            # the backward finishes dQ itself only where the counters can say who adds last
            assert not opts["FINISH"] or counted, key
            tma = ["descriptor", [1, 1, 128, d]]
            assert row["dkv"] == ([tma, tma] if opts["DKV_TMA"] else [["tensor", [b, hk, t, d]]] * 2), key
        assert rows[f"{d} True []"]["options"]["FIRST_STORE"] == defaults["first_store"]
        assert rows[f"{d} False []"]["options"]["FIRST_STORE"] == defaults["atomic_first_store"]
        assert rows[f"{d} True []"]["options"]["FINISH"] == defaults["finish"]
        assert rows[f"{d} True [('first_store', False)]"]["dq32_zero"]
        assert rows[f"{d} False [('finish', True)]"]["options"]["FINISH"] == defaults["atomic_first_store"]
        assert rows[f"{d} False [('finish', True), ('first_store', True)]"]["options"]["FINISH"]
        assert rows[f"{d} True [('dkv_tma', True), ('finish', True)]"]["options"]["DKV_TMA"]


def test_forward_grid_schedule_and_stores(launches):
    b, h, hk, t = 2, 4, 2, 1000
    work = -(-t // launches["defaults"]["fwd_block_m"]) * b * h
    for key, row in launches["fwd"].items():
        d, fix, programs = key.split()
        assert row["grid"] == [min(work, int(programs))], key
        # the tile counter only where programs take tiles as they finish (fewer programs than tiles)
        assert row["dynamic"] == (int(programs) < work), key
        assert row["counter"] == (["tensor", [1]] if row["dynamic"] else ["tensor", [b, h, t]]), key
        assert [row["o_tma"], row["o32_tma"]] == row["plan"], key
        assert (row["o"][0] == "descriptor") == row["o_tma"] and (row["o32"][0] == "descriptor") == row["o32_tma"]
        assert row["group"] == h // hk, key
    assert "Q_SLOT" in launches["unknown_choice"] and "Q_SLOTS" in launches["unknown_choice"]
