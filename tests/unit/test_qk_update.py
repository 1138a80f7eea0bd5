"""The Q-K update and activation spectra (launcher/monitors/qk_update.py) against NumPy SVDs of the explicit
matrices, on small random shapes."""

import math

import numpy as np
import pytest
import torch

from launcher.monitors import tags
from launcher.monitors.qk_update import (QKUpdateTracker, activation_entropy, layer_aggregates, spectral_entropy,
                                         token_positions, update_spectra)


def _entropy(sv: np.ndarray, rank_bound: int) -> float:
    p = sv / sv.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / math.log(rank_bound))


def _stats(d: np.ndarray, keep: int) -> tuple[float, float, float]:
    sv = np.linalg.svd(d, compute_uv=False)[:keep]  # the rest are zero up to rounding
    return _entropy(sv, keep), float((sv ** 2).sum() / sv[0] ** 2), float(np.linalg.norm(d))


@pytest.mark.parametrize("heads, hd, d, step", [(3, 4, 16, 0.05), (2, 8, 24, 1.0), (1, 2, 5, 0.3)])
def test_update_spectra_match_numpy_svd_of_the_explicit_terms(heads, hd, d, step, seed):
    g = torch.Generator().manual_seed(seed)
    wq0, wk0 = torch.randn(heads, hd, d, generator=g), torch.randn(heads, hd, d, generator=g)
    wq1 = wq0 + step * torch.randn(heads, hd, d, generator=g)
    wk1 = wk0 + step * torch.randn(heads, hd, d, generator=g)
    got = update_spectra(wq0, wk0, wq1, wk1)
    assert set(got) == set(tags.QK_UPDATE_STATS)
    for h in range(heads):
        q0, k0, q1, k1 = (w[h].double().numpy() for w in (wq0, wk0, wq1, wk1))
        dq, dk = q1 - q0, k1 - k0
        first, second = dq.T @ k0 + q0.T @ dk, dq.T @ dk
        np.testing.assert_allclose(first + second, q1.T @ k1 - q0.T @ k0, atol=1e-10)  # the split is exact
        for suffix, term, keep in (("", first, min(2 * hd, d)), ("2", second, min(hd, d))):
            entropy, srank, norm = _stats(term, keep)
            assert got[f"entropy{suffix}"][h].item() == pytest.approx(entropy, rel=1e-6)
            assert got[f"srank{suffix}"][h].item() == pytest.approx(srank, rel=1e-6)
            assert got[f"norm{suffix}"][h].item() == pytest.approx(norm, rel=1e-6)


def test_entropy_limits_and_a_repeated_rank_one_update():
    assert spectral_entropy(torch.ones(1, 8)).item() == pytest.approx(1.0)  # flat: every direction alike
    assert spectral_entropy(torch.tensor([[3.0, 0, 0, 0]])).item() == pytest.approx(0.0)  # one direction
    assert math.isnan(spectral_entropy(torch.zeros(1, 4)).item())  # no update, no spectrum
    # the paper's mechanism: the same rank-1 error added to dW_Q on top of a random update lowers the entropy
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    noise = 0.01 * torch.randn(1, 8, 32, generator=g)
    u, v = torch.randn(1, 8, 1, generator=g), torch.randn(1, 1, 32, generator=g)
    random_update = update_spectra(wq, wk, wq + noise, wk)["entropy"].item()
    biased_update = update_spectra(wq, wk, wq + noise + 0.2 * u * v, wk)["entropy"].item()
    assert biased_update < random_update - 0.1, (biased_update, random_update)


@pytest.mark.parametrize("tokens", [6, 40])  # fewer tokens than head_dim (direct SVD) and more (the QR path)
def test_activation_entropy_matches_numpy(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 3, 20, 8, generator=g), torch.randn(2, 3, 20, 8, generator=g)
    positions = token_positions(2, 20, tokens)
    assert len(positions) == tokens and len(set(positions.tolist())) == tokens
    got = activation_entropy(q, k, positions)
    for h in range(3):
        qs = q[:, h].reshape(-1, 8)[positions].double().numpy()
        ks = k[:, h].reshape(-1, 8)[positions].double().numpy()
        keep = min(tokens, 8)
        sv = np.linalg.svd(qs @ ks.T / math.sqrt(8), compute_uv=False)[:keep]
        assert got[h].item() == pytest.approx(_entropy(sv, keep), rel=1e-6)


def test_tracker_first_call_stores_and_the_next_measures(seed):
    g = torch.Generator().manual_seed(seed)
    tracker = QKUpdateTracker()
    wq, wk = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, 16, generator=g)
    assert tracker(1, wq, wk) is None
    wq2 = wq + 0.1 * torch.randn(2, 4, 16, generator=g)
    got = tracker(1, wq2, wk)
    want = update_spectra(wq, wk, wq2, wk)
    for stat in want:
        torch.testing.assert_close(got[stat], want[stat], rtol=0, atol=0, equal_nan=True)
    assert got["norm2"].abs().max() == 0 and got["entropy2"].isnan().all()  # W_K did not move: no second order
    layer = layer_aggregates(got)
    assert layer["entropy"].item() == pytest.approx(got["entropy"].mean().item())
    assert layer["norm"].item() == pytest.approx(got["norm"].square().sum().sqrt().item())
