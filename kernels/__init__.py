"""Flash attention with explicit, selectable rounding (Qiu & Yao, arXiv 2510.04212): Triton kernel and reference.

``flash_attention`` runs the Triton kernel (CUDA; CPU only under TRITON_INTERPRET=1, for tests);
``reference_attention`` is the PyTorch implementation of the same tiling and rounding points (CPU training path and
ground truth); ``saved_output`` returns the O that the backward uses for delta = rowsum(dO * O). Modes: ``rounding``
in ROUNDINGS x ``fix`` in FIXES; the delta-error stress ``delta_gain`` / ``delta_sign`` (DELTA_SIGNS) and the noise
keys (``kernels.rounding.row_keys`` / ``layer_keys``); see docs/attention-kernel.md.

The Triton module is imported on first use, so that importing ``kernels`` needs no GPU and so that a test can set
TRITON_INTERPRET=1 before the kernels are defined.
"""

from __future__ import annotations

import torch

from kernels.modes import DELTA_SIGNS, FIXES, PAPER_BLOCK_KEYS, ROUNDINGS
from kernels.reference import reference_attention, reference_saved_output
from kernels.rounding import layer_keys, mix32, row_keys

__all__ = ["ROUNDINGS", "FIXES", "DELTA_SIGNS", "flash_attention", "reference_attention", "saved_output", "mix32",
           "row_keys", "layer_keys"]

BACKENDS = ("reference", "triton")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, rounding: str = "fa2",
                    fix: str = "none", beta: float = 2.0, eps: float = 1e-3, *,
                    paper_block_keys: int = PAPER_BLOCK_KEYS, head_offset: int = 0,
                    total_heads: int = 0, delta_gain: float = 1.0, delta_sign: str = "kept",
                    noise_keys: torch.Tensor | None = None, autotune: bool = True,
                    out_fill: float | None = None, deterministic: bool = True) -> torch.Tensor:
    """Triton flash attention with selectable rounding; differentiable, a torch custom op (torch.compile-safe).

    q, k, v: (batch, heads, seq, head_dim) bf16 or fp16 on CUDA, head_dim 16/32/64/128, k/v may have fewer heads
    (grouped-query attention). Returns O in the input dtype. ``rounding``: fa2 | paper; ``fix``: none |
    dynamic_max (safe, default fix) | dynamic_max_published (the paper's rule; where it underflows, the authors'
    row-sum clamp zeroes the row) | fp32_output (delta from an FP32 O) | stochastic_output (O stochastically
    rounded to bf16 from the FP32 O in the forward epilogue; bf16 only). ``beta`` and ``eps`` parametrise the
    published rule. ``paper_block_keys``: keys per rounding tile of rounding=paper (512 as in the authors' code, 0:
    the whole row as in the paper's analysis; a power of two >= 64 otherwise); ignored by rounding=fa2.

    ``head_offset``, ``total_heads`` (tensor parallelism): q's head h is the model's head ``head_offset + h`` of
    ``total_heads`` (0 means q.shape[1], no sharding). Head-dependent numerics (the safe fix's per-row shift, the
    noise hash) use this global index, so the result does not depend on how the heads are split over ranks.

    ``delta_gain``, ``delta_sign`` (stress test of the delta error): the backward uses
    delta = delta_fp32 + delta_gain * s * (delta_mode - delta_fp32), delta_mode = rowsum(dO * O_mode) (the O the mode
    saves), delta_fp32 = rowsum(dO * O_fp32) (the FP32 O of fp32_output); s = +1 (``"kept"``) or +-1 per (row key,
    global head, query position) (``"random"``). delta_gain=1 with "kept" is exactly the mode's own code path.
    ``noise_keys``: int64 (batch,), one key per batch row (``kernels.rounding.layer_keys``; None: 0 for every row),
    used by stochastic_output and random signs only.

    ``autotune``: True times the tile configurations on the first call of each shape and mode and keeps the fastest;
    False uses the fixed 64 x 64 tiles (as under the interpreter). The key tile sets the order of the FP32 sums, so
    only with fixed tiles are the last bits independent of which configuration won the timing (another GPU, process
    or rank), and does rounding=fa2 match ``reference_attention`` with ``block_n=64``.
    ``out_fill``: what the output and gradient buffers start filled with (None: uninitialised, the fast default).
    Tests pass NaN, so that an element no launch writes shows up. Neither changes a bit of a result.
    ``deterministic``: True computes dQ in its own launch, each query tile summing its key tiles in a fixed order
    (bit-reproducible from run to run); False adds each key tile's share of dQ into an FP32 buffer with atomics
    inside the dK/dV launch (two matrix products fewer per tile pair, as FA2 and cuDNN do it; the sums then come
    in the order the tiles finish, so dQ's last bits can change from run to run; dK and dV do not). Speed of
    both: docs/attention-kernel.md, "Speed".
    """
    from kernels import triton_flash

    return triton_flash.flash_attention(q, k, v, causal, rounding, fix, beta, eps, paper_block_keys=paper_block_keys,
                                        head_offset=head_offset, total_heads=total_heads, delta_gain=delta_gain,
                                        delta_sign=delta_sign, noise_keys=noise_keys, autotune=autotune,
                                        out_fill=out_fill, deterministic=deterministic)


def saved_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, rounding: str = "fa2",
                 fix: str = "none", beta: float = 2.0, eps: float = 1e-3, backend: str = "reference",
                 paper_block_keys: int = PAPER_BLOCK_KEYS, head_offset: int = 0, total_heads: int = 0,
                 delta_gain: float = 1.0, delta_sign: str = "kept", noise_keys: torch.Tensor | None = None,
                 autotune: bool = True, out_fill: float | None = None) -> torch.Tensor:
    """The O tensor whose rowsum(dO * O) is the backward's delta in this mode (forward only, no graph).

    LP O (input dtype; bf16 for FP32 inputs on the reference backend), the stochastically rounded O for
    fix=stochastic_output, or the FP32 O for fix=fp32_output. On the amplified delta path (delta_gain != 1 or
    delta_sign="random") the FP32 O_fp32 + delta_gain * s * (O_mode - O_fp32): delta is linear in O, so its delta is
    the backward's up to the FP32 rounding of the sums. Other arguments as in ``flash_attention``; ``autotune`` and
    ``out_fill`` apply to the triton backend (the reference's forward allocates no buffer it fills piecewise).
    """
    kw = dict(paper_block_keys=paper_block_keys, head_offset=head_offset, total_heads=total_heads,
              delta_gain=delta_gain, delta_sign=delta_sign, noise_keys=noise_keys)
    if backend == "reference":
        return reference_saved_output(q, k, v, causal, rounding, fix, beta, eps, **kw)
    if backend == "triton":
        from kernels import triton_flash

        return triton_flash.saved_output(q, k, v, causal, rounding, fix, beta, eps, autotune=autotune,
                                         out_fill=out_fill, **kw)
    raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
