"""CPU check of the paper-speed session's one change to the reference: the backward's exponent S*log2e - LSE*log2e
instead of (S - LSE)*log2e. Gradients of paper/none on 5 random causal (4, 2, 128, 64) bf16 cases: their mean
relative error against fp64 with the reference of <tree>, and (first case) saved for an old/new comparison.

    git archive 2d40124 kernels | tar -x -C .devcache/old   # the reference before the change
    python docs/device-runs/2026-12-01-paper/reference_exponent_check.py . /tmp/g_new.pt
    python docs/device-runs/2026-12-01-paper/reference_exponent_check.py .devcache/old /tmp/g_old.pt
    python docs/device-runs/2026-12-01-paper/reference_exponent_check.py --compare /tmp/g_new.pt /tmp/g_old.pt
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())  # tests.attention_common from this repository
if sys.argv[1] != "--compare":
    sys.path.insert(0, os.path.abspath(sys.argv[1]))  # kernels from <tree>


def main():
    if sys.argv[1] == "--compare":
        new, old = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        for name, a, b in zip(("dq", "dk", "dv"), new, old):
            print(f"{name}: {(a != b).float().mean().item():.4%} of elements differ, relative norm of the difference "
                  f"{((a - b).norm() / b.norm()).item():.2e}")
        return
    import kernels
    from tests.attention_common import fp64_out_and_grads

    print("kernels from", kernels.__file__)
    torch.manual_seed(0)
    errs = []
    for trial in range(5):
        q, k, v, do = (torch.randn(4, 2, 128, 64).mul(3 if i < 2 else 1).bfloat16() for i in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kernels.reference_attention(q, k, v, True, "paper", "none").backward(do)
        grads = [t.grad.float() for t in (q, k, v)]
        exact = fp64_out_and_grads(q, k, v, do, True)[1]
        errs.append([((a - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, exact)])
        if trial == 0:
            torch.save(grads, sys.argv[2])
    print("mean relative error against fp64 (dq, dk, dv):", [f"{sum(e[i] for e in errs) / 5:.7f}" for i in range(3)])


if __name__ == "__main__":
    main()
