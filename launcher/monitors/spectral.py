"""Spectral norms (largest singular values) by power iteration with persistent vectors.

A spectral norm is tracked, not recomputed: each tracked batch of matrices keeps its current estimate of the top
right singular vectors between calls, so a few power-iteration steps per call follow the slowly changing weights.
The very first call (and any call whose shapes changed) starts from the exact top singular vector, obtained from an
eigendecomposition of the smaller Gram matrix, so the first logged value is exact rather than a cold-start guess.
After the configured steps, iteration continues while the estimate still rises by more than ``tol`` per step (the
power-iteration estimate never decreases), up to ``max_iterations``.

A matrix split over a tensor-parallel group is tracked without gathering it (:func:`sharded_power_iteration`): each
rank holds its rows (a column-parallel weight, split 0) or its columns (row-parallel, split 1), the products W v and
W^T u are formed from the ranks' parts with one all-reduce of a vector each, and the exact start sums the ranks'
Gram matrices (one d x d all-reduce). So the working set is this rank's slice and a d x d matrix, never the whole
weight; the right singular vector is replicated (split 0) or split like the columns (split 1).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
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


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(t, group=group)
    return t


@torch.no_grad()
def sharded_top_singular_exact(mats: torch.Tensor, split: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_singular_exact` of (G, m, n) matrices of which this rank holds the rows (``split`` 1 of the batch's
    dims, i.e. dim 0 of each matrix) or the columns (``split`` 2): the Gram matrix that sums over the split
    dimension is all-reduced (W^T W for rows, W W^T for columns), and v is this rank's part of it (all of it for
    rows)."""
    mats = mats.float()
    if split == 1:  # rows: W^T W = sum_r W_r^T W_r; v (n) whole on every rank
        evals, evecs = torch.linalg.eigh(_summed(mats.transpose(-1, -2) @ mats, group))
        v = evecs[..., -1]
    else:  # columns: W W^T = sum_r W_r W_r^T; u (m) whole, v_r = W_r^T u normalised over the ranks
        evals, evecs = torch.linalg.eigh(_summed(mats @ mats.transpose(-1, -2), group))
        v = _normalized((mats.transpose(-1, -2) @ evecs[..., -1].unsqueeze(-1)).squeeze(-1), split, group)
    return _sharded_norm_of_product(mats, v, split, group)[0], v


def _normalized(v: torch.Tensor, split: int, group) -> torch.Tensor:
    """v / |v| per matrix; with split 2 the vector's parts are spread over the group."""
    if split == 1:
        return F.normalize(v, dim=-1)
    return v / _summed(v.square().sum(dim=-1), group).sqrt().clamp_min(1e-30).unsqueeze(-1)


def _sharded_norm_of_product(mats: torch.Tensor, v: torch.Tensor, split: int, group
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(|W v| per matrix, W v as this rank holds it: its rows' part for split 1, the whole vector for split 2)."""
    wv = (mats @ v.unsqueeze(-1)).squeeze(-1)
    if split == 1:
        return _summed(wv.square().sum(dim=-1), group).sqrt(), wv
    wv = _summed(wv, group)
    return torch.linalg.vector_norm(wv, dim=-1), wv


@torch.no_grad()
def sharded_power_iteration(mats: torch.Tensor, v: torch.Tensor, split: int, group, iterations: int, tol: float = 0.0,
                            max_iterations: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`power_iteration` on (G, m, n) matrices split over ``group`` (see :func:`sharded_top_singular_exact`);
    ``v`` is this rank's part of the right singular vectors. Two vector all-reduces per step."""
    mats = mats.float()
    v = _normalized(v.to(mats.device, torch.float32), split, group)
    max_iterations = max(iterations, max_iterations or iterations)
    sigma, wv = _sharded_norm_of_product(mats, v, split, group)
    for i in range(max_iterations):
        u = wv / sigma.clamp_min(1e-30).unsqueeze(-1)
        wtu = (mats.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1)
        v = _normalized(_summed(wtu, group) if split == 1 else wtu, split, group)
        new_sigma, wv = _sharded_norm_of_product(mats, v, split, group)
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
    def __call__(self, name: str, mats: torch.Tensor, split: Optional[int] = None, group=None) -> torch.Tensor:
        """Spectral-norm estimates (G,) of the (G, m, n) batch ``mats``, tracked under ``name``. ``split`` (1: rows,
        2: columns) and ``group``: this rank holds that part of each matrix, the rest is on the group's other ranks
        (every rank of the group must make the same call)."""
        v = self.vectors.get(name)
        fresh = v is None or v.shape != (mats.shape[0], mats.shape[-1])
        if split is None or group is None or dist.get_world_size(group) == 1:
            sigma, v = top_singular_exact(mats) if fresh else \
                power_iteration(mats, v, self.iterations, self.tol, self.max_iterations)
        else:
            # every rank of the group must take the same branch: a fresh start anywhere restarts all
            flag = torch.tensor([float(fresh)], device=mats.device)
            if _summed(flag, group).item():
                sigma, v = sharded_top_singular_exact(mats, split, group)
            else:
                sigma, v = sharded_power_iteration(mats, v, split, group, self.iterations, self.tol,
                                                   self.max_iterations)
        self.vectors[name] = v
        return sigma

    def state_dict(self) -> dict:
        return {name: v.detach().cpu().clone() for name, v in self.vectors.items()}

    def load_state_dict(self, state: dict, device: Optional[torch.device] = None) -> None:
        self.vectors = {name: v.to(device) if device is not None else v.clone() for name, v in state.items()}
