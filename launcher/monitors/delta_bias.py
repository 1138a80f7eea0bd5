"""Delta-bias monitor: how far the backward's delta = rowsum(dO * O) is from exact, and whether the error adds up.

For one layer on the probe batch (q, k, v, its attention output and the gradient dO arriving at it):

- delta_lp = rowsum(dO * O_saved) with O_saved the output the run's backward uses (the kernel's BF16 O, or its FP32
  O for fix=fp32_output), computed in FP32 as the kernel does;
- delta_hp = rowsum(dO * O_exact) with O_exact the exact softmax attention of the same (BF16-rounded) q, k, v in FP64;
- the per-head sum over batch and positions of delta_lp - delta_hp. A sum that keeps one sign call after call is the
  paper's danger signal;
- the error it puts into W_Q's gradient, dW_Q_hp - dW_Q_lp = alpha * sum_t (delta_lp - delta_hp)[t] (P K)[t]^T X[t]
  per head (rows of head h of q_proj.weight); the cosine between successive calls' error matrices near 1 means
  the errors point the same way and accumulate instead of cancelling.

Backend ``sdpa``: torch's fused kernels save the very output they return, so O_saved is the captured output itself
(exact, no emulation) and O_exact uses q, k, v as they were, unrounded.

O_saved is what ``kernels.saved_output`` returns for the run's own attention settings (the object the model's
attention was built with: rounding, fix, delta_gain and delta_sign, the global head index, the backend and the
kernel's tiles) and noise keys, so delta_lp is the delta the run's backward forms. The probe batch runs without the
trainer's row keys: its keys are those of row key 0 (``model.attention.noise_keys(None, layer, ...)``), the same at
every call, which the monitors pass here.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from kernels.reference import exact_attention
from launcher.monitors.attention_stats import kernel_inputs


def saved_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, backend: str,
                 settings=None, noise_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention output the run's backward multiplies dO with to form delta. ``settings``: the run's
    ``kernels.modes.AttentionSettings`` (what the model's attention was built with: numerics, global head index,
    backend and launch options, so O is recomputed with the run's tiles); None for backend=sdpa. ``noise_keys``: as
    the run's attention gets them."""
    if backend == "sdpa":
        return o
    import kernels  # lazily: the sdpa path must not need kernels/ (Triton)

    return kernels.saved_output(kernel_inputs(q, backend), kernel_inputs(k, backend), kernel_inputs(v, backend),
                                settings, noise_keys=noise_keys)


@torch.no_grad()
def delta_difference(d_out: torch.Tensor, o_saved: torch.Tensor, o_exact: torch.Tensor) -> torch.Tensor:
    """delta_lp - delta_hp per row, (B, H, T) in FP64; delta_lp is accumulated in FP32 like the kernel's."""
    delta_lp = (d_out.float() * o_saved.float()).sum(dim=-1)
    delta_hp = (d_out.double() * o_exact).sum(dim=-1)
    return delta_lp.double() - delta_hp


@torch.no_grad()
def dwq_error(diff: torch.Tensor, p: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-head error of W_Q's gradient, (H, head_dim, d_model) in FP64 (see module docstring).

    diff: (B, H, T) delta_lp - delta_hp; p: (B, H, T, T) exact probabilities; k: (B, H, T, hd); x: (B, T, d) the
    input of q_proj."""
    alpha = 1.0 / math.sqrt(k.shape[-1])
    pk = p @ k.double()  # (B, H, T, hd)
    return alpha * torch.einsum("bht,bhtc,btd->hcd", diff, pk, x.double())


def cosine(a: torch.Tensor, b: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Cosine similarity of a and b over ``dims`` (0 where either is zero)."""
    return cosine_from_parts((a * b).sum(dim=dims), a.square().sum(dim=dims), b.square().sum(dim=dims))


def cosine_from_parts(dot: torch.Tensor, a_sq: torch.Tensor, b_sq: torch.Tensor) -> torch.Tensor:
    """Cosine from a.b, |a|^2 and |b|^2 (0 where either is zero); sums of the parts over heads give a layer's cosine,
    which is how the heads of different tensor-parallel ranks are combined."""
    den = (a_sq * b_sq).sqrt()
    return torch.where(den > 0, dot / den.clamp_min(1e-300), torch.zeros_like(dot))


@torch.no_grad()
def layer_delta_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, d_out: torch.Tensor,
                     x: torch.Tensor, backend: str, settings=None, previous_error: Optional[torch.Tensor] = None,
                     noise_keys: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Delta-bias results of one layer: ``sum`` (H,) of delta_lp - delta_hp over batch and positions, the W_Q
    gradient ``error`` (H, hd, d) and, given the previous call's error, cosines ``dwq_cos`` (whole layer, scalar)
    and ``dwq_cos_head`` (H,) with their parts per head (``dot``, ``error_sq``, ``previous_sq``). ``settings``,
    ``noise_keys``: see :func:`saved_output`."""
    o_saved = saved_output(q, k, v, o, backend, settings, noise_keys)
    qi, ki, vi = (kernel_inputs(t, backend) for t in (q, k, v))
    o_exact, p = exact_attention(qi, ki, vi, causal=True)
    diff = delta_difference(d_out, o_saved, o_exact)
    error = dwq_error(diff, p, ki, x)
    out = {"sum": diff.sum(dim=(0, 2)), "error": error}
    if previous_error is not None and previous_error.shape == error.shape:
        prev = previous_error.to(error.device, error.dtype)
        out["dot"], out["error_sq"] = (error * prev).sum(dim=(1, 2)), error.square().sum(dim=(1, 2))
        out["previous_sq"] = prev.square().sum(dim=(1, 2))
        out["dwq_cos"] = cosine_from_parts(out["dot"].sum(), out["error_sq"].sum(), out["previous_sq"].sum())
        out["dwq_cos_head"] = cosine_from_parts(out["dot"], out["error_sq"], out["previous_sq"])
    return out
