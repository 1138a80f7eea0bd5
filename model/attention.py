"""Attention implementations the model can call, chosen by config.

Every implementation takes q, k, v shaped (batch, heads, seq, head_dim) and returns the causal attention output in
the same shape and dtype, and accepts the keywords ``layer`` (global layer index) and ``row_keys`` (an int64 (batch,)
tensor of per-row keys from ``kernels.rounding.row_keys``, or None). The numerics that matter for the paper's failure
(where BF16 rounding happens inside flash attention, and which fix is applied) are the ``rounding`` and ``fix``
settings; the stress mode ``delta_gain`` / ``delta_sign`` scales the backward's delta error; see kernels/ and
docs/attention-kernel.md.

Row keys are the only source of randomness (random delta signs, fix=stochastic_output): they are passed as arguments
from the trainer through the model, never kept in module state, so activation checkpointing recomputes with the same
keys and the draws depend on (run seed, step, layer, global batch row), not on the process layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

# attention_fn(q, k, v, *, layer: int = 0, row_keys: Optional[torch.Tensor] = None) -> o
AttentionFn = Callable[..., torch.Tensor]

BACKENDS = ("auto", "triton", "gluon", "reference", "sdpa")


@dataclass
class AttentionConfig:
    """Which attention implementation runs and with which rounding numerics."""

    backend: str = "auto"
    """auto (on a CUDA GPU the Triton kernel, or on a Hopper GPU the Gluon kernel where it is the faster one:
    head_dim 128, rounding=fa2 with fix none, fp32_output or stochastic_output; on CPU the PyTorch reference of the
    same numerics), triton, gluon (the Gluon Hopper kernel for every call it can run, the Triton kernel for the
    others, said once), reference, or sdpa (torch's fused attention: production numerics only, rounding=fa2 and
    fix=none)."""
    rounding: str = "fa2"
    """Where BF16 rounding happens: fa2 (FP32 scores and accumulator, one final cast, as in FA2/FA3 and SDPA) or
    paper (the authors' rounding points: BF16 scores, per-tile BF16 P_bar V, BF16 running O and row sums)."""
    fix: str = "none"
    """Bias fix: none; dynamic_max (bounded, per-row shift of the softmax maximum when it repeats: the paper's rule
    made safe against underflow); dynamic_max_published (the paper's rule as the authors run it: where it
    underflows, their row-sum clamp silently zeroes the row); fp32_output (delta from an FP32 copy of O: the
    recipes' fixed arms, the widest measured stability margin, docs/results.md); stochastic_output (O rounded to
    BF16 stochastically from the FP32 O, unbiased, keyed per row, head, position and channel; needs BF16 attention
    inputs: precision.dtype=bf16, or the reference backend, which rounds FP32 inputs to BF16); exact_delta (the
    forward of none; the backward's delta is rowsum(P * dP) in FP32 with its own P, one more pass over the key
    tiles, instead of rowsum(dO * O))."""
    paper_block_keys: int = 512
    """Keys per tile of rounding=paper: the running O and row sum are rounded to BF16 once per tile, and the fixes
    look for repeated maxima per tile. 512 as in the authors' code; 0 puts the whole row in one tile (the paper's
    analysis); otherwise a power of two >= 64. Ignored by rounding=fa2."""
    beta: float = 2.0
    """Shift factor of the dynamic-maximum fixes (the paper uses 2; its earlier value was 7)."""
    eps: float = 1e-3
    """Scores within eps of the row maximum count as ties (the fixes' trigger and the tie-rate monitor's)."""
    delta_gain: float = 1.0
    """Stress test of the backward (finite, >= 0): delta = delta_ref + delta_gain x s x (delta_mode - delta_ref),
    delta_mode = the delta the mode computes (rowsum(dO * O)), delta_ref as delta_reference says. 1.0 is the mode's
    own numerics (bit-identical, no extra cost); 0 gives the reference's delta. Not with backend=sdpa."""
    delta_sign: str = "kept"
    """s in delta_gain's formula: kept (+1, the error keeps its sign) or random (+-1 per row, head and query
    position, hashed from run seed, step, layer and global batch row: the same error size without a persistent
    sign, the control of the bias). Not with backend=sdpa."""
    delta_reference: str = "fp32_output"
    """delta_ref of delta_gain's formula: fp32_output (rowsum(dO * O_fp32), the FP32 O of the same forward:
    fix=fp32_output's delta, so that fix has no error to amplify) or exact (rowsum(P * dP) with the backward's own P:
    fix=exact_delta's delta; one more pass over the key tiles). Used only when delta_gain != 1 or delta_sign=random."""
    output_gain: float = 1.0
    """Stress test of the forward (finite, >= 0): the attention output the next layer sees is
    LP(O_fp32 + output_gain x s x (O_mode - O_fp32)), O_mode the mode's own LP output, O_fp32 its FP32 O (paper: the
    FP32 shadow accumulation), so the forward's rounding error is amplified the way delta_gain amplifies the
    backward's; the backward's delta still uses O_mode (the two paths are stressed separately). 1.0 is the mode's own
    numerics (bit-identical); 0 gives the FP32 O rounded once to nearest. Not with backend=sdpa."""
    output_sign: str = "kept"
    """s in output_gain's formula: kept (+1) or random (+-1 per row, head and query position, hashed like
    delta_sign's random signs but independent of them: the control)."""
    autotune: bool = True
    """Triton backend only (ignored by the others): true times the kernel's tile configurations on the first call of
    each shape and keeps the fastest; false runs the fixed 64 x 64 tiles. The key tile sets the order of the FP32
    sums, so with autotuning the last bits of O and the gradients can depend on which configuration won the timing
    (another GPU, process or data-parallel rank); false makes them fixed, at some cost in speed."""
    deterministic: bool = True
    """The Triton and Gluon kernels (ignored by the others): true gives dQ the same bits from run to run (the Triton
    kernel computes it in its own launch; the Gluon kernel adds its per-key-tile shares in a fixed order); false
    adds the shares with FP32 atomics as key tiles finish (as FA2 and cuDNN do), so dQ's last bits vary from run to
    run. Measured (docs/attention-kernel.md, Speed): in the Triton kernel ~10% faster backward at sequence length
    4096 and head_dim 128, none at 1024 and 64; in the Gluon kernel 0-6% faster fwd+bwd."""

    @property
    def numerics(self) -> str:
        """Short label used in logs and run names, e.g. 'paper/dynamic_max'."""
        return f"{self.rounding}/{self.fix}"

    @property
    def stresses_delta(self) -> bool:
        """Whether delta_gain / delta_sign differ from the mode's own numerics (then the kernel gets them)."""
        return (self.delta_gain, self.delta_sign) != (1.0, "kept")

    @property
    def stresses_output(self) -> bool:
        """Whether output_gain / output_sign differ from the mode's own numerics."""
        return (self.output_gain, self.output_sign) != (1.0, "kept")

    @property
    def needs_noise_keys(self) -> bool:
        """Whether the attention draws random bits, so that the trainer must pass row keys (random signs, or the
        stochastic rounding of fix=stochastic_output). Every other run calls the model exactly as before."""
        return self.fix == "stochastic_output" or "random" in (self.delta_sign, self.output_sign)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int = 0,
                   row_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch's scaled_dot_product_attention, causal; its rounding is fixed by the backend torch picks. It draws no
    random bits: ``layer`` and ``row_keys`` are ignored."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def noise_keys(row_keys: Optional[torch.Tensor], layer: int, batch: int, device: torch.device) -> torch.Tensor:
    """The kernel's ``noise_keys`` of one layer: the row keys with the global layer index mixed in
    (``kernels.rounding.layer_keys``). ``row_keys`` None means key 0 for every row: evaluation and the monitors'
    probe batch run without the trainer's keys, i.e. with this fixed key."""
    from kernels.rounding import layer_keys  # lazily, like kernels below

    if row_keys is None:
        row_keys = torch.zeros(batch, dtype=torch.int64, device=device)
    elif row_keys.shape != (batch,):
        raise ValueError(f"row_keys has shape {tuple(row_keys.shape)}; expected one key per batch row, ({batch},)")
    return layer_keys(row_keys, layer)


def attention_settings(config: AttentionConfig, head_offset: int = 0, total_heads: int = 0):
    """The kernels' settings record (``kernels.modes.AttentionSettings``) of ``config``, for a rank whose first q
    head is the model's head ``head_offset`` of ``total_heads`` (0: as many as q has, i.e. not sharded). Built once
    by ``build_attention``; the monitors read the same object from the model (``KernelAttention.settings``)."""
    from kernels.modes import AttentionSettings  # no Triton: kernels.modes is plain Python

    if config.backend == "sdpa":
        raise ValueError("attention.backend=sdpa runs torch's attention, which has no kernel settings")
    return AttentionSettings(causal=True, rounding=config.rounding, fix=config.fix, beta=config.beta, eps=config.eps,
                             paper_block_keys=config.paper_block_keys, delta_gain=config.delta_gain,
                             delta_sign=config.delta_sign, delta_reference=config.delta_reference,
                             output_gain=config.output_gain, output_sign=config.output_sign,
                             head_offset=head_offset, total_heads=total_heads,
                             backend=config.backend, autotune=config.autotune, deterministic=config.deterministic)


class KernelAttention:
    """The Triton kernel or its reference with the run's settings bound (``settings``, an
    ``kernels.modes.AttentionSettings``; ``kernels.attention`` picks the implementation).

    With ``keyed`` (the settings draw random bits) each call turns (row_keys, layer) into the kernel's
    ``noise_keys``; otherwise ``layer`` and ``row_keys`` are ignored."""

    def __init__(self, settings, keyed: bool):
        self.settings, self.keyed = settings, keyed

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layer: int = 0,
                 row_keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        import kernels  # lazily, like build_attention

        keys = noise_keys(row_keys, layer, q.shape[0], q.device) if self.keyed else None
        return kernels.attention(q, k, v, self.settings, keys)


def resolve_backend(config: AttentionConfig, device: torch.device, head_dim: Optional[int] = None) -> str:
    """The concrete backend for ``config.backend`` on ``device`` and the model's ``head_dim``: sdpa, or the kernels'
    choice (``kernels.implementation``; for auto: gluon or triton on CUDA, reference on CPU)."""
    if config.backend == "sdpa":
        return "sdpa"
    import kernels

    return kernels.implementation(attention_settings(config), device, head_dim)


def build_attention(config: AttentionConfig, device: torch.device, head_offset: int = 0,
                    total_heads: int = 0) -> AttentionFn:
    """Return the attention callable the model will use, bound to the config's settings.

    ``head_offset`` and ``total_heads`` are for tensor parallelism: the callable's q head h is the model's head
    ``head_offset + h`` of ``total_heads`` (0: as many as q has, i.e. not sharded). The Triton and reference
    backends use this global head index in their head-dependent numerics (the dynamic_max fix's per-row shift), so
    the result does not change with the tensor-parallel degree; the slice is checked at the first call. The sdpa
    backend has no head-dependent numerics and ignores them. ``device`` is not needed to bind them: with
    backend=auto, ``kernels.attention`` picks the implementation per call from the tensors' device (the model's).
    """
    if config.backend == "sdpa":
        return sdpa_attention
    settings = attention_settings(config, head_offset, total_heads)
    return KernelAttention(settings, keyed=settings.needs_noise_keys)
