"""Attention diagnostics on the probe batch: tie rate, maximum logit and entropy per head.

The scores are S = alpha q k^T (alpha = 1/sqrt(head_dim)), causally masked, in the precision the run's rounding
materialises them: BF16-rounded for ``rounding=paper`` (the authors' kernel keeps S in BF16), FP32 for ``fa2``.
A row *ties* when its maximum is attained at least twice within ``eps`` (the published fix's trigger, here on whole
rows rather than per key tile). Ties are what make several P_bar entries exactly 1 and bias the BF16 rounding of O.

The *tile tie rate* counts the rows in the kernel's terms: the row's maximum attained at least twice inside one key
tile of the run's numerics (``kernels.modes.tie_tile_keys``: the paper tile for rounding=paper, where two maxima
in different tiles do not bias; the 64-key tile in which the safe fix counts ties for fa2), within the safe fix's
tie band max(eps, 2^-8) (every score whose P_bar rounds to exactly 1 in bf16), not only within eps.
"""

from __future__ import annotations

import math

import torch

from kernels.modes import TIE_GAP


def kernel_inputs(t: torch.Tensor, backend: str) -> torch.Tensor:
    """The tensor as the run's attention sees it: the kernels and their reference round FP32 inputs to BF16."""
    return t.to(torch.bfloat16) if backend in ("triton", "gluon", "reference") else t


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


def tie_band(eps: float) -> float:
    """The safe fix's tie band in natural score units: max(eps, 2^-8), as the kernel widens it for bf16."""
    return max(eps, TIE_GAP[torch.bfloat16])


def tile_ties(s: torch.Tensor, band: float, tile: int) -> torch.Tensor:
    """Rows (B, H, T) whose maximum is attained >= 2 times within ``band`` inside one ``tile``-key tile (0: the
    whole row) of masked scores s (B, H, T, T)."""
    near = (s.amax(dim=-1, keepdim=True) - s) <= band
    keys = s.shape[-1]
    if tile <= 0 or tile >= keys:
        return near.sum(dim=-1) >= 2
    pad = -keys % tile
    near = torch.nn.functional.pad(near, (0, pad))
    return (near.view(*near.shape[:-1], -1, tile).sum(dim=-1) >= 2).any(dim=-1)


@torch.no_grad()
def head_stats(s: torch.Tensor, eps: float, tile: int = 0) -> dict[str, torch.Tensor]:
    """Per-head statistics (each of shape (H,)) of masked scores s (B, H, T, T).

    tie_rate: fraction of rows (over batch and positions) whose maximum is attained >= 2 times within eps.
    tile_tie_rate: fraction of rows whose maximum is attained >= 2 times within ``tie_band(eps)`` inside one
    ``tile``-key tile (0: anywhere in the row). max_logit: largest score. entropy: mean over rows of the softmax
    entropy in nats."""
    row_max = s.amax(dim=-1, keepdim=True)
    ties = ((row_max - s) <= eps).sum(dim=-1) >= 2
    p = torch.softmax(s, dim=-1)
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    return {
        "tie_rate": ties.float().mean(dim=(0, 2)),
        "tile_tie_rate": tile_ties(s, tie_band(eps), tile).float().mean(dim=(0, 2)),
        "max_logit": row_max.squeeze(-1).amax(dim=(0, 2)),
        "entropy": entropy.mean(dim=(0, 2)),
    }


def layer_stats(per_head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer aggregates: mean tie rates and entropy over heads, maximum of the heads' max logits."""
    return {
        "tie_rate": per_head["tie_rate"].mean(),
        "tile_tie_rate": per_head["tile_tie_rate"].mean(),
        "max_logit": per_head["max_logit"].amax(),
        "entropy": per_head["entropy"].mean(),
    }
