"""Spectral norms (largest singular values) by power iteration with persistent vectors.

A spectral norm is tracked, not recomputed: each tracked batch of matrices keeps its current estimate of the top
right singular vectors between calls, so a few power-iteration steps per call follow the slowly changing weights.
The very first call (and any call whose shapes changed) starts from the exact top singular vector, obtained from an
eigendecomposition of the smaller Gram matrix, so the first logged value is exact rather than a cold-start guess.
After the configured steps, iteration continues while the estimate still rises by more than ``tol`` per step (the
power-iteration estimate never decreases), up to ``max_iterations``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


@torch.no_grad()
def top_singular_exact(mats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest singular value (G,) and its right singular vector (G, n) of each matrix of a (G, m, n) batch."""
    mats = mats.float()
    m, n = mats.shape[-2:]
    if m < n:  # eigendecompose the smaller Gram matrix W W^T, then map u back to v = W^T u / sigma
        evals, evecs = torch.linalg.eigh(mats @ mats.transpose(-1, -2))
        u = evecs[..., -1]
        v = F.normalize((mats.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1), dim=-1)
    else:
        evals, evecs = torch.linalg.eigh(mats.transpose(-1, -2) @ mats)
        v = evecs[..., -1]
    sigma = torch.linalg.vector_norm((mats @ v.unsqueeze(-1)).squeeze(-1), dim=-1)
    return sigma, v


@torch.no_grad()
def power_iteration(mats: torch.Tensor, v: torch.Tensor, iterations: int, tol: float = 0.0,
                    max_iterations: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine right singular vectors v (G, n) of mats (G, m, n); return (sigma estimate (G,), new v).

    Runs ``iterations`` steps, then more (up to ``max_iterations``) while any estimate rose by more than ``tol``
    (relative) in the last step. ``tol=0`` means exactly ``iterations`` steps and no host synchronisation."""
    mats = mats.float()
    v = F.normalize(v.to(mats.device, torch.float32), dim=-1)
    max_iterations = max(iterations, max_iterations or iterations)
    wv = (mats @ v.unsqueeze(-1)).squeeze(-1)
    sigma = torch.linalg.vector_norm(wv, dim=-1)
    for i in range(max_iterations):
        u = wv / sigma.clamp_min(1e-30).unsqueeze(-1)
        v = F.normalize((mats.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1), dim=-1)
        wv = (mats @ v.unsqueeze(-1)).squeeze(-1)
        new_sigma = torch.linalg.vector_norm(wv, dim=-1)
        rise = ((new_sigma - sigma) / new_sigma.clamp_min(1e-30)).max()
        sigma = new_sigma
        if i + 1 >= iterations and (tol <= 0 or rise.item() <= tol):
            break
    return sigma, v


class SpectralTracker:
    """Named batches of matrices whose spectral norms are tracked across calls with persistent vectors."""

    def __init__(self, iterations: int = 3, tol: float = 1e-4, max_iterations: Optional[int] = None):
        self.iterations = max(1, int(iterations))
        self.tol = tol
        self.max_iterations = max_iterations or 8 * self.iterations
        self.vectors: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, name: str, mats: torch.Tensor) -> torch.Tensor:
        """Spectral-norm estimates (G,) of the (G, m, n) batch ``mats``, tracked under ``name``."""
        v = self.vectors.get(name)
        if v is None or v.shape != (mats.shape[0], mats.shape[-1]):
            sigma, v = top_singular_exact(mats)
        else:
            sigma, v = power_iteration(mats, v, self.iterations, self.tol, self.max_iterations)
        self.vectors[name] = v
        return sigma

    def state_dict(self) -> dict:
        return {name: v.detach().cpu().clone() for name, v in self.vectors.items()}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        self.vectors = {name: v.to(device) if device is not None else v.clone() for name, v in state.items()}
