"""The forward's variants of call 3 (two Q slots per consumer; the next tile's first Q K^T issued before the
epilogue, ``FWD_CROSS_TILE``) and of 2026-12-07-boundary (O divided with one reciprocal per row,
``FWD_ROW_DIVIDE``; the bf16 O by TMA, ``FWD_O_TMA``) give the same bits as the default (one slot, not cross-tile): O, LSE and the FP32 O of
fa2/none, fp32_output and stochastic_output, on shapes with more tiles than programs (the tile counter), a launch
of one program per tile (the static schedule), grouped heads, ragged sequences and both head sizes.

    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/same_bits.py [VARIANT ...]

(no VARIANT: every one; call 3 runs each in its own process and time limit, so that a variant that hangs on the GPU
costs only its own result)
"""
import sys

import torch

from kernels import gluon_flash as gf
from kernels.modes import AttentionSettings

DEFAULT = {"FWD_Q_SLOTS": 1, "FWD_ROW_DIVIDE": False, "FWD_O_TMA": False}
# (the cross-tile variants, "2 Q slots cross-tile" and "1 Q slot cross-tile", went with FWD_CROSS_TILE after
# 2026-12-07-boundary's call 1b; their runs are in this folder's and that folder's logs)
VARIANTS = {"2 Q slots": {"FWD_Q_SLOTS": 2},
            "row divide": {"FWD_ROW_DIVIDE": True},  # 2026-12-07-boundary: O = acc / l, one reciprocal per row
            "O by TMA": {"FWD_O_TMA": True},
            "O by TMA + row divide": {"FWD_O_TMA": True, "FWD_ROW_DIVIDE": True}}  # 2026-12-07-boundary: the bf16 O staged in shared memory, TMA store


def forward_with(values, *args, **kwargs):
    for key, value in {**DEFAULT, **values}.items():
        setattr(gf, key, value)
    try:
        return gf._forward(*args, **kwargs)
    finally:
        for key, value in DEFAULT.items():
            setattr(gf, key, value)


# (batch, heads, K/V heads, tokens, head_dim, scale of V): V scaled by 2^-70 (2^66) puts |acc| below (above) the
# range where FWD_ROW_DIVIDE divides per row, so its tiles take gl.div_rn (the fallback runs too)
CASES = [(3, 6, 2, 2085, 128, 1.0), (3, 6, 2, 2085, 64, 1.0), (8, 12, 12, 1024, 64, 1.0), (1, 2, 2, 300, 128, 1.0),
         (2, 4, 4, 200, 64, 1.0), (4, 16, 16, 2048, 128, 1.0), (1, 2, 2, 300, 128, 2.0**-70),
         (1, 2, 2, 300, 128, 2.0**66)]
chosen = sys.argv[1:] or list(VARIANTS)
unknown = [v for v in chosen if v not in VARIANTS]
if unknown:
    sys.exit(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
bad = 0
for b, h, hk, t, d, v_scale in CASES:
    torch.manual_seed(t + d)
    q = torch.randn(b, t, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, t, hk, d, device="cuda").to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    v = (v.float() * v_scale).to(torch.bfloat16)
    keys = torch.randint(0, 2**31, (b,), device="cuda", dtype=torch.int64)
    for fix in ("none", "fp32_output", "stochastic_output"):
        for causal in (True, False):
            nm = AttentionSettings(causal=causal, fix=fix).numerics(d, q.dtype)
            base = forward_with({}, q, k, v, causal, nm, noise_keys=keys, fill=float("nan"))
            for variant in chosen:
                values = VARIANTS[variant]
                outs = forward_with(values, q, k, v, causal, nm, noise_keys=keys, fill=float("nan"))
                same = all(torch.equal(x, y) for x, y in zip(base, outs))
                finite = all(bool(torch.isfinite(x).all()) for x in outs)
                ok = same and finite
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} {b},{h}/{hk},{t},{d} V*{v_scale:g} {fix} causal={causal} {variant}: same bits "
                      f"{same}, finite {finite}", flush=True)
print(f"same_bits: {bad} bad")
sys.exit(1 if bad else 0)
