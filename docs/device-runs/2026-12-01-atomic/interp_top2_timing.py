"""CPU, not a device run: interpreted kernel time of one forward and one forward+backward per mode at (2, 4, 90, 16),
the measurement behind the _row_top2 change (docs/attention-kernel.md, "Speed").

    PYTHONPATH=. python docs/device-runs/2026-12-01-atomic/interp_top2_timing.py
"""
import os, time; os.environ["TRITON_INTERPRET"]="1"
import torch, kernels
from tests.attention_common import tied_maxima_inputs, out_and_grads
torch.manual_seed(0)
q,k,v,d = tied_maxima_inputs(2,4,2,90,dim=16)
for r in ("fa2","paper"):
    for fix in ("none","dynamic_max"):
        t=time.time(); kernels.flash_attention(q,k,v,True,r,fix); t1=time.time()-t
        t=time.time(); out_and_grads(kernels.flash_attention,q,k,v,d,causal=True,rounding=r,fix=fix); t2=time.time()-t
        t=time.time(); kernels.reference_attention(q,k,v,True,r,fix,block_n=64); t3=time.time()-t
        print(r, fix, f"fwd {t1:.2f}s fwd+bwd {t2:.2f}s ref {t3:.2f}s", flush=True)
