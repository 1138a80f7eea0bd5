"""Is FMA contraction in the plain delta launch why gain 0 and fix=fp32_output give other dq bits on the GPU?
Runs the failing comparison of test_gain_one_is_the_mode_and_gain_zero_the_fp32_output_delta (fixed tiles), then
the same with the plain delta launch compiled without FP fusion, like the gain launch. Prints both results."""

import torch

import kernels
from kernels import triton_flash as tf


def grads(q, k, v, d_out, rounding, fix, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kernels.flash_attention(*leaves, True, rounding, fix, autotune=False, **kw).backward(d_out)
    return [t.grad for t in leaves]


def differing(rounding, seed):
    torch.manual_seed(seed)
    q, k, v, d_out = (torch.randn(2, 4, 300, 64, device="cuda").bfloat16() for _ in range(4))
    zero, fp32 = grads(q, k, v, d_out, rounding, "none", delta_gain=0.0), grads(q, k, v, d_out, rounding, "fp32_output")
    return {n: int((a != b).sum()) for n, a, b in zip("qkv", zero, fp32)}


fused = tf.DELTA
for label in ("plain delta launch as shipped (FP fusion on)", "plain delta launch with enable_fp_fusion=False"):
    if "False" in label:
        tf.DELTA = tf._Kernel(tf._bwd_delta_kernel, dict(BLOCK_M=64, enable_fp_fusion=False))
    for rounding in ("fa2", "paper"):
        counts = [differing(rounding, seed) for seed in range(5)]
        print(f"{label}, {rounding}: elements of dq/dk/dv that differ, 5 seeds: {counts}")
tf.DELTA = fused
