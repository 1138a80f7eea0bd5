"""Attention implementations the model can call, chosen by config.

Every implementation takes q, k, v shaped (batch, heads, seq, head_dim) and returns the causal attention output in
the same shape and dtype. The numerics that matter for the paper's failure (where BF16 rounding happens inside
flash attention, and which fix is applied) are the ``rounding`` and ``fix`` settings; see kernels/ and
docs/attention-kernel.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

BACKENDS = ("auto", "triton", "reference", "sdpa")


@dataclass
class AttentionConfig:
    """Which attention implementation runs and with which rounding numerics."""

    backend: str = "auto"
    """auto (Triton kernel on CUDA, PyTorch reference of the same numerics on CPU), triton, reference, or sdpa
    (torch's fused attention: production numerics only, rounding=fa2 and fix=none)."""
    rounding: str = "fa2"
    """Where BF16 rounding happens: fa2 (FP32 scores and accumulator, one final cast, as in FA2/FA3 and SDPA) or
    paper (the authors' rounding points: BF16 scores, per-tile BF16 P_bar V, BF16 running O and row sums)."""
    fix: str = "none"
    """Bias fix: none; dynamic_max (bounded, per-row shift of the softmax maximum when it repeats: the safe
    default); dynamic_max_published (the paper's rule as the authors run it: where it underflows, their row-sum
    clamp silently zeroes the row); fp32_output (delta from an FP32 copy of O)."""
    paper_block_keys: int = 512
    """Keys per tile of rounding=paper: the running O and row sum are rounded to BF16 once per tile, and the fixes
    look for repeated maxima per tile. 512 as in the authors' code; 0 puts the whole row in one tile (the paper's
    analysis); otherwise a power of two >= 64. Ignored by rounding=fa2."""
    beta: float = 2.0
    """Shift factor of the dynamic-maximum fixes (the paper uses 2; its earlier value was 7)."""
    eps: float = 1e-3
    """Scores within eps of the row maximum count as ties (the fixes' trigger and the tie-rate monitor's)."""

    @property
    def numerics(self) -> str:
        """Short label used in logs and run names, e.g. 'paper/dynamic_max'."""
        return f"{self.rounding}/{self.fix}"


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's scaled_dot_product_attention, causal; its rounding is fixed by the backend torch picks."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def resolve_backend(config: AttentionConfig, device: torch.device) -> str:
    """The concrete backend for ``config.backend`` on ``device`` (auto picks triton on CUDA, reference on CPU)."""
    if config.backend != "auto":
        return config.backend
    return "triton" if device.type == "cuda" else "reference"


def build_attention(config: AttentionConfig, device: torch.device, head_offset: int = 0,
                    total_heads: int = 0) -> AttentionFn:
    """Return the attention callable the model will use, bound to the config's numerics.

    ``head_offset`` and ``total_heads`` are for tensor parallelism: the callable's q head h is the model's head
    ``head_offset + h`` of ``total_heads`` (0: as many as q has, i.e. not sharded). The Triton and reference
    backends use this global head index in their head-dependent numerics (the dynamic_max fix's per-row shift), so
    the result does not change with the tensor-parallel degree; the values are checked at the first call. The sdpa
    backend has no head-dependent numerics and ignores them.
    """
    backend = resolve_backend(config, device)
    if backend == "sdpa":
        return sdpa_attention
    import kernels  # imported lazily: kernels/ pulls in triton, which the sdpa path does not need

    fn = kernels.flash_attention if backend == "triton" else kernels.reference_attention
    return functools.partial(
        fn, causal=True, rounding=config.rounding, fix=config.fix, beta=config.beta, eps=config.eps,
        paper_block_keys=config.paper_block_keys, head_offset=head_offset, total_heads=total_heads,
    )
