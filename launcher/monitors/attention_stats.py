"""Attention diagnostics on the probe batch: tie rate, maximum logit and entropy per head.

The scores are S = alpha q k^T (alpha = 1/sqrt(head_dim)), causally masked, in the precision the run's rounding
materialises them: BF16-rounded for ``rounding=paper`` (the authors' kernel keeps S in BF16), FP32 for ``fa2``.
A row *ties* when its maximum is attained at least twice within ``eps`` (the fixes' trigger, here on whole rows
rather than per key tile). Ties are what make several P_bar entries exactly 1 and bias the BF16 rounding of O_bar.
"""

from __future__ import annotations

import math

import torch


def kernel_inputs(t: torch.Tensor, backend: str) -> torch.Tensor:
    """The tensor as the run's attention sees it: the Triton kernel and its reference round FP32 inputs to BF16."""
    return t.to(torch.bfloat16) if backend in ("triton", "reference") else t


@torch.no_grad()
def scores(q: torch.Tensor, k: torch.Tensor, rounding: str) -> torch.Tensor:
    """Causally masked scores (B, H, T, T) in FP32 holding the values the kernel works with; masked entries -inf."""
    t = q.shape[-2]
    qk = q.float() @ k.float().transpose(-1, -2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if rounding == "paper":  # S = bf16(bf16(q.k) * scale), as the authors' autocast computes it
        s = (qk.to(torch.bfloat16).float() * scale).to(torch.bfloat16).float()
    else:
        s = qk * scale
    mask = torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1)
    return s.masked_fill(mask, float("-inf"))


@torch.no_grad()
def head_stats(s: torch.Tensor, eps: float) -> dict[str, torch.Tensor]:
    """Per-head statistics (each of shape (H,)) of masked scores s (B, H, T, T).

    tie_rate: fraction of rows (over batch and positions) whose maximum is attained >= 2 times within eps.
    max_logit: largest score. entropy: mean over rows of the softmax entropy in nats."""
    row_max = s.amax(dim=-1, keepdim=True)
    ties = ((row_max - s) <= eps).sum(dim=-1) >= 2
    p = torch.softmax(s, dim=-1)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    return {
        "tie_rate": ties.float().mean(dim=(0, 2)),
        "max_logit": row_max.squeeze(-1).amax(dim=(0, 2)),
        "entropy": entropy.mean(dim=(0, 2)),
    }


def layer_stats(per_head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer aggregates: mean tie rate and entropy over heads, maximum of the heads' max logits."""
    return {
        "tie_rate": per_head["tie_rate"].mean(),
        "max_logit": per_head["max_logit"].amax(),
        "entropy": per_head["entropy"].mean(),
    }
