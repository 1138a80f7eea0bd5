"""A few fwd+bwd calls of the Gluon kernels at one shape, for Nsight Compute (the lead's profile call).

    PYTHONPATH=. ncu --clock-control none -k regex:"_fwd_kernel|_bwd_kernel" --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats --section SourceCounters -o prof \\
        python docs/device-runs/2026-12-02-gluon/profile.py 4,16,4096,128
"""
import sys

import torch

sys.path.insert(0, "docs/device-runs/2026-12-02-gluon")
from probe import gluon  # noqa: E402

b, h, t, d = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4,16,4096,128").split(","))
q, k, v = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
           for _ in range(3))
d_out = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    torch.autograd.grad(gluon(q, k, v, True, "none", False), (q, k, v), d_out)
torch.cuda.synchronize()
print("done")
