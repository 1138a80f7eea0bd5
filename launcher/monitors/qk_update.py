"""Spectra of the query-key bilinear form: how its update between monitor calls is shaped, and its activations.

Head h scores a query token x against a key token y with x^T M_h y, M_h = W_Q,h^T W_K,h (d x d, rank <= head_dim),
W_Q,h and W_K,h the head's (head_dim x d) rows of q_proj.weight and k_proj.weight. Between two monitor calls the
weights move by dW_Q, dW_K and M_h by

    M(t1) - M(t0) = D2 + D3,   D2 = dW_Q^T W_K + W_Q^T dW_K   (first order, weights of t0),
                               D3 = dW_Q^T dW_K               (second order),

kept apart as Huang et al. (arXiv 2606.28116) do: they report that the spectral entropy of the first-order term
turns abnormal long before a low-precision attention run diverges, while weight and gradient norms tell nothing.
The paper's mechanism (Qiu & Yao, arXiv 2510.04212) predicts why: a delta error of one sign adds nearly the same
rank-1 matrix to dW_Q step after step, so the update concentrates on few directions and its entropy drops.

For each head and term: the normalised spectral entropy H = -sum p_i log p_i / log r with p_i = sigma_i / sum sigma
(the effective rank of Roy & Vetterli, 2007, as a fraction; 1 = flat spectrum over the r possible directions, 0 = a
single direction), the stable rank ||D||_F^2 / sigma_max^2 and the Frobenius norm. The singular values come from the
factors, never from a d x d matrix: D2 = A B with A = [dW_Q^T, W_Q^T] (d x 2hd) and B = [W_K; dW_K] (2hd x d), so
with A = Q_a R_a and B^T = Q_b R_b (thin QR), sigma(D2) = sigma(R_a R_b^T), a 2hd x 2hd problem per head
(docs/monitoring.md gives the cost at GPT-2 small and 1.3B shapes).

The activation variant needs no weight copies: the normalised spectral entropy of the pre-softmax score matrix
alpha q_s k_s^T of a few tokens sub-sampled from the probe batch (the same positions at every call), per head.

Every function works on the heads a rank holds (whole heads per tensor-parallel rank), so a sharded run computes
each head from its own rows and the monitors gather the per-head values in global head order.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def spectral_entropy(sigma: torch.Tensor, rank_bound: Optional[int] = None) -> torch.Tensor:
    """Normalised spectral entropy of singular values ``sigma`` (..., r): -sum p log p / log(rank_bound or r) with
    p = sigma / sum(sigma). NaN where every singular value is 0 (no update: no spectrum)."""
    r = rank_bound or sigma.shape[-1]
    total = sigma.sum(dim=-1, keepdim=True)
    p = sigma / total
    entropy = -torch.special.xlogy(p, p).sum(dim=-1)
    return torch.where(total.squeeze(-1) > 0, entropy / math.log(r), torch.full_like(entropy, math.nan))


def stable_rank(sigma: torch.Tensor) -> torch.Tensor:
    """||D||_F^2 / sigma_max^2 from singular values (..., r); NaN for a zero matrix."""
    top = sigma.amax(dim=-1)
    return torch.where(top > 0, sigma.square().sum(dim=-1) / top.square().clamp_min(1e-300),
                       torch.full_like(top, math.nan))


def product_singular_values(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Singular values of a @ b_t^T for batches a (G, d, r1) and b_t (G, d, r2), d >= r1, r2, without forming the
    d x d product: with a = Q_a R_a and b_t = Q_b R_b, sigma(a b_t^T) = sigma(R_a R_b^T). Returns (G, min(r1, r2))."""
    ra = torch.linalg.qr(a, mode="r").R
    rb = torch.linalg.qr(b_t, mode="r").R
    return torch.linalg.svdvals(ra @ rb.transpose(-1, -2))


@torch.no_grad()
def update_spectra(wq0: torch.Tensor, wk0: torch.Tensor, wq1: torch.Tensor, wk1: torch.Tensor) -> dict[str, torch.Tensor]:
    """Statistics (each (H,)) of the first- and second-order update terms of M_h = W_Q,h^T W_K,h between the head
    blocks (H, hd, d) of the previous call (wq0, wk0) and this call (wq1, wk1); see the module docstring."""
    wq0, wk0, wq1, wk1 = (w.double() for w in (wq0, wk0, wq1, wk1))
    dq, dk = wq1 - wq0, wk1 - wk0
    hd = dq.shape[1]
    # D2 = [dW_Q^T, W_Q^T] @ [W_K; dW_K]: both factors as (H, d, 2hd) column blocks
    first = product_singular_values(torch.cat([dq, wq0], dim=1).transpose(1, 2),
                                    torch.cat([wk0, dk], dim=1).transpose(1, 2))
    second = product_singular_values(dq.transpose(1, 2), dk.transpose(1, 2))
    d = dq.shape[2]
    return {
        "entropy": spectral_entropy(first, min(2 * hd, d)),
        "srank": stable_rank(first),
        "norm": first.square().sum(dim=-1).sqrt(),
        "entropy2": spectral_entropy(second, min(hd, d)),
        "srank2": stable_rank(second),
        "norm2": second.square().sum(dim=-1).sqrt(),
    }


def token_positions(batch: int, seq_len: int, tokens: int) -> torch.Tensor:
    """``tokens`` flat indices into the (batch * seq_len) probe tokens, evenly spaced (all of them if fewer)."""
    total = batch * seq_len
    n = min(tokens, total)
    return torch.linspace(0, total - 1, n).round().long()


@torch.no_grad()
def activation_entropy(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Normalised spectral entropy (H,) of the pre-softmax scores alpha q_s k_s^T of the sub-sampled tokens
    ``positions`` (flat indices over batch x sequence) of q, k (B, H, T, hd); alpha = 1/sqrt(hd) only scales the
    spectrum and leaves the entropy as it is."""
    b, h, t, hd = q.shape
    rows, cols = (positions // t).to(q.device), (positions % t).to(q.device)
    qs, ks = (x[rows, :, cols].transpose(0, 1).double() for x in (q, k))  # (H, n, hd): the sampled tokens only
    n = qs.shape[1]
    sigma = product_singular_values(qs, ks) if n >= hd else torch.linalg.svdvals(qs @ ks.transpose(1, 2))
    return spectral_entropy(sigma, min(n, hd))


def layer_aggregates(per_head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer values of per-head statistics (H,): entropies and stable ranks averaged over heads (NaN heads left out),
    norms as the root sum of squares (the Frobenius norm of all heads' blocks together)."""
    return {stat: (values.square().sum().sqrt() if stat.startswith("norm") else values.nanmean())
            for stat, values in per_head.items()}


class QKUpdateTracker:
    """The previous call's W_Q and W_K head blocks of each watched layer (this rank's heads), and the statistics of
    the update since then. The first call of a layer only stores its weights (no update yet)."""

    def __init__(self):
        self.previous: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, layer: int, wq: torch.Tensor, wk: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        """``wq``, ``wk``: (H, hd, d) head blocks now. Returns the statistics of the update since the previous call of
        ``layer`` (None on its first call, or when the head blocks changed shape)."""
        wq, wk = wq.detach().float().clone(), wk.detach().float().clone()
        prev = self.previous.get(layer)
        self.previous[layer] = (wq, wk)
        if prev is None or prev[0].shape != wq.shape:
            return None
        return update_spectra(prev[0].to(wq.device), prev[1].to(wq.device), wq, wk)
