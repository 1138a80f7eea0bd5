"""The forward with two Q slots per consumer gives the same bits as with one (call 3): O, LSE and the FP32 O of
fa2/none, fp32_output and stochastic_output, on shapes with more tiles than programs (the tile counter), a launch
of one program per tile (the static schedule), grouped heads, ragged sequences and both head sizes.

    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/same_bits.py
"""
import sys

import torch

from kernels import gluon_flash as gf
from kernels.modes import AttentionSettings

CASES = [(3, 6, 2, 2085, 128), (3, 6, 2, 2085, 64), (8, 12, 12, 1024, 64), (1, 2, 2, 300, 128), (2, 4, 4, 200, 64),
         (4, 16, 16, 2048, 128)]
bad = 0
for b, h, hk, t, d in CASES:
    torch.manual_seed(t + d)
    q = torch.randn(b, t, h, d, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, t, hk, d, device="cuda").to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    keys = torch.randint(0, 2**31, (b,), device="cuda", dtype=torch.int64)
    for fix in ("none", "fp32_output", "stochastic_output"):
        for causal in (True, False):
            nm = AttentionSettings(causal=causal, fix=fix).numerics(d, q.dtype)
            outs = []
            for slots in (1, 2):
                gf.FWD_Q_SLOTS = slots
                outs.append(gf._forward(q, k, v, causal, nm, noise_keys=keys, fill=float("nan")))
            same = all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
            finite = all(bool(torch.isfinite(x).all()) for x in outs[1])
            ok = same and finite
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {b},{h}/{hk},{t},{d} {fix} causal={causal}: same bits {same}, "
                  f"finite {finite}", flush=True)
print(f"same_bits: {bad} bad")
gf.FWD_Q_SLOTS = 1
sys.exit(1 if bad else 0)
