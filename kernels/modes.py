"""Numerics modes of flash attention (rounding x fix) and the argument checks both implementations share."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kernels.rounding import LOG2E

ROUNDINGS = ("fa2", "paper")
FIXES = ("none", "dynamic_max", "dynamic_max_published", "fp32_output", "stochastic_output", "exact_delta")
DELTA_SIGNS = ("kept", "random")  # sign of the amplified delta error (delta_gain): as computed, or +-1 per row
# What the amplified delta error is measured from (delta_gain): delta_fp32 = rowsum(dO * O_fp32), fix=fp32_output's
# delta, or delta_exact = rowsum(P * dP) with the backward's own P, fix=exact_delta's delta.
DELTA_REFERENCES = ("fp32_output", "exact")
REFERENCE_FIX = {"fp32_output": "fp32_output", "exact": "exact_delta"}  # the fix whose delta is the reference
HEAD_DIMS = (16, 32, 64, 128)  # head sizes the kernel (and its reference) supports

# rounding=paper rounds the running O and l to LP once per tile of this many keys (the authors' code: 512);
# 0 puts the whole row in one tile (the paper's analysis). Ignored by rounding=fa2.
PAPER_BLOCK_KEYS = 512
# The authors' code clamps every tile's row sum at this floor; the published rule needs it (see _tile_max).
ROW_SUM_FLOOR = 1e-10

# Integer codes of the fixes inside the kernel (constexpr) and the reference.
FIX_NONE, FIX_SAFE, FIX_PUBLISHED, FIX_FP32_OUTPUT, FIX_STOCHASTIC, FIX_EXACT_DELTA = range(6)
FIX_CODE = dict(zip(FIXES, range(6)))

# Safe dynamic_max counts as tied every score whose P_bar would round to exactly 1 next to the maximum: within
# ln(1 / (1 - 2^-9)) ~ 0.00196 (bf16) or ~0.00024 (fp16) of it. The published eps = 1e-3 misses part of the bf16 band,
# so the safe fix uses max(eps, TIE_GAP[dtype]) (nats).
TIE_GAP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# Key tile (block_n) of the reference and of the kernel's fixed configuration (interpreter, autotune=False); the
# autotuner's key tiles are multiples of it. rounding=fa2 counts the fixes' ties per key tile (the safe fix also
# against a maximum repeated in an earlier tile); rounding=paper rounds its running O and l, and counts ties, per
# paper tile (PAPER_BLOCK_KEYS keys), whatever the key tile.
KEY_TILE = 64


def mode_kwargs(rounding: str, fix: str, paper_block_keys: int | None = None) -> dict:
    """Keyword arguments that select a numerics mode in ``reference_attention``, ``saved_output`` and
    ``flash_attention``: the one place a caller passes the paper tile size (keys per rounding tile of
    rounding=paper; 0 = the whole row). ``None`` leaves it out, so the kernels' own default applies."""
    kwargs = {"rounding": rounding, "fix": fix}
    if paper_block_keys is not None:
        kwargs["paper_block_keys"] = paper_block_keys
    return kwargs


def tie_tile_keys(rounding: str, paper_block_keys: int | None = None) -> int:
    """Keys per tile in which a repeated maximum matters for the run's numerics (0 = the whole row).

    paper: the paper tile (``paper_block_keys``; None: PAPER_BLOCK_KEYS): two maxima in different tiles meet as exact
    bf16 partial sums and do not bias. fa2: KEY_TILE, where the safe fix counts ties inside a tile (ties across tiles
    bias fa2 too, and its safe fix catches them against the running maximum; the whole-row tie rate measures those)."""
    if rounding == "paper":
        return PAPER_BLOCK_KEYS if paper_block_keys is None else paper_block_keys
    return KEY_TILE


def _fp32(x: float) -> float:
    """x rounded to the nearest FP32 value: scalars reach Triton kernels as FP32, so the reference uses the same."""
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class Numerics:
    """Resolved mode and FP32 scalars of one attention call, identical for kernel and reference.

    The row maximum is taken in the "max domain": the natural score S = LP(LP(q.k) * scale) for rounding=paper (the
    authors' autocast rounds the product, then the scaled scores), the raw FP32 q.k for rounding=fa2 (whose
    P_bar = exp2((q.k - m) * scale*log2(e)): subtracting before scaling keeps the largest term exactly 1 for any
    logit, where a fused q.k*scale - m would leave the product's rounding error, huge at huge logits, in the
    exponent).
    """

    paper: bool
    fix: int
    sm_scale: float  # 1/sqrt(head_dim), FP32
    score_scale: float  # q.k -> max domain: sm_scale (paper) or 1 (fa2)
    exp_scale: float  # max-domain difference -> exponent of exp2: log2(e) (paper) or sm_scale*log2(e) (fa2)
    shift_scale: float  # safe-shift delta (nats for paper, bits for fa2) -> max domain: 1 (paper), 1/exp_scale (fa2)
    beta: float
    eps_cmp: float  # tie tolerance in the max domain (widened for dynamic_max)
    paper_tile: int  # keys per rounding tile of rounding=paper (0: the whole row); 0 for rounding=fa2
    delta_gain: float = 1.0  # FP32; delta = delta_ref + gain * s * (delta_mode - delta_ref)
    delta_random: bool = False  # s = +-1 per row from the noise hash (else s = +1)
    delta_exact_ref: bool = False  # delta_ref = rowsum(P * dP) (delta_reference=exact), else rowsum(dO * O_fp32)
    output_gain: float = 1.0  # FP32; the O returned is LP(O_fp32 + gain * s * (O_mode - O_fp32))
    output_random: bool = False  # its s = +-1 per row from the noise hash (another salt than the delta's)
    # paper, bf16 and a power-of-two sm_scale (head_dim 16, 64): LP(q.k) * scale is a bf16 value already (down to
    # FP32's smallest normal), so the kernel leaves out S's second rounding (triton_flash._paper_score); same bits
    score_rounds_once: bool = False

    @property
    def amplified(self) -> bool:
        """The delta-error stress path (delta_gain != 1 or random signs): it needs the reference delta (the FP32 O,
        or the exact pass) besides the mode's. False is exactly the mode's own code path."""
        return self.delta_gain != 1.0 or self.delta_random

    @property
    def stochastic(self) -> bool:
        return self.fix == FIX_STOCHASTIC

    @property
    def exact_pass(self) -> bool:
        """The backward first computes delta_exact = rowsum(P * dP) over the key tiles: fix=exact_delta's delta, or
        the reference of the amplified path with delta_reference=exact."""
        return self.fix == FIX_EXACT_DELTA or (self.amplified and self.delta_exact_ref)

    @property
    def keeps_fp32_output(self) -> bool:
        """The forward stores the FP32 normalised O (fp32_output's O, or delta_fp32 of the amplified path)."""
        return self.fix == FIX_FP32_OUTPUT or (self.amplified and not self.delta_exact_ref)

    @property
    def output_amplified(self) -> bool:
        """The forward-error stress (output_gain != 1 or random signs): the O returned is the FP32 O plus the
        amplified rounding error, the mode's own O is kept for the backward's delta. False: the mode's code path."""
        return self.output_gain != 1.0 or self.output_random

    @property
    def shadow(self) -> bool:
        """rounding=paper keeps an FP32 shadow accumulation: the FP32 O of fp32_output, of the amplified path's
        delta_fp32, of the output stress, and the value that stochastic_output rounds."""
        return self.paper and (self.keeps_fp32_output or self.stochastic or self.output_amplified)

    @property
    def needs_noise_keys(self) -> bool:
        return self.stochastic or self.delta_random or self.output_random


def paper_block_keys_problem(paper_block_keys) -> str | None:
    """Why ``paper_block_keys`` is not a valid paper tile size (None if it is)."""
    n = paper_block_keys
    if isinstance(n, bool) or not isinstance(n, int) or (n != 0 and (n < 64 or n & (n - 1))):
        return (f"paper_block_keys={n!r} must be 0 (the whole row in one tile, as in the paper's analysis) or a power "
                f"of two >= 64 (the authors' code uses {PAPER_BLOCK_KEYS})")
    return None


# What computes a call (kernels.implementation): auto (on CUDA the Gluon Hopper kernel where it is the faster one,
# else the Triton kernel; the reference elsewhere), or one by name. The sdpa backend of the model's config is torch's
# own attention, not one of these.
BACKENDS = ("auto", "triton", "gluon", "reference")

# The modes kernels/gluon_flash.py implements (those that change only the forward's epilogue or the delta) and the
# head sizes it takes; head_dim 128 is where it is faster than the Triton kernel (docs/attention-kernel.md, Speed),
# so backend=auto picks it there only.
GLUON_FIXES = ("none", "fp32_output", "stochastic_output")
GLUON_HEAD_DIMS = (64, 128)
GLUON_AUTO_HEAD_DIMS = (128,)


def gluon_numerics(settings) -> bool:
    """Whether the Gluon kernel implements these settings' numerics (rounding=fa2 with a fix it takes; not the
    output stress, nor the exact reference of the delta stress: those are the Triton kernel's)."""
    exact_reference = settings.amplified and settings.delta_reference == "exact"
    return (settings.rounding == "fa2" and settings.fix in GLUON_FIXES and not settings.output_amplified
            and not exact_reference)


def _is_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


@dataclass(frozen=True)
class AttentionSettings:
    """Everything that decides what an attention call computes and how it is launched, apart from the tensors and
    the noise keys: built once (``model.attention.attention_settings`` from the run's config) and handed as one
    object from the model through ``kernels.attention`` to the implementation, and to the monitors and probes that
    recompute the run's attention. Checked when made; errors say what to change. The fields' order is the
    positional order of ``kernels.flash_attention`` / ``reference_attention`` (q, k, v, causal, rounding, fix, ...).
    """

    causal: bool = True
    rounding: str = "fa2"  # ROUNDINGS
    fix: str = "none"  # FIXES
    beta: float = 2.0  # shift factor of dynamic_max_published (> 1)
    eps: float = 1e-3  # tie tolerance of the fixes (>= 0)
    paper_block_keys: int = PAPER_BLOCK_KEYS  # keys per rounding tile of rounding=paper (0: the whole row)
    delta_gain: float = 1.0  # delta = delta_fp32 + gain * s * (delta_mode - delta_fp32)
    delta_sign: str = "kept"  # DELTA_SIGNS: s = +1, or +-1 per row from the noise hash
    delta_reference: str = "fp32_output"  # DELTA_REFERENCES: delta_ref of the delta_gain formula
    output_gain: float = 1.0  # forward stress: O returned = LP(O_fp32 + gain * s * (O_mode - O_fp32))
    output_sign: str = "kept"  # DELTA_SIGNS: s = +1, or +-1 per row (its own hash salt)
    head_offset: int = 0  # q's head h is the model's head head_offset + h of total_heads (tensor parallelism)
    total_heads: int = 0  # 0: q.shape[1], not sharded
    backend: str = "auto"  # BACKENDS: which implementation computes the call (kernels.implementation)
    autotune: bool = True  # compiled kernels: time the tile configurations (False: the fixed 64 x 64 tiles)
    deterministic: bool = True  # compiled kernels: dQ in its own launch (False: FP32 atomics in the dK/dV launch)
    out_fill: float | None = None  # what output buffers start filled with (None: uninitialised; tests pass NaN)

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal={self.causal!r} must be True or False")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is not one of {ROUNDINGS}")
        if self.fix not in FIXES:
            raise ValueError(f"fix={self.fix!r} is not one of {FIXES}")
        for name in ("beta", "eps", "delta_gain", "output_gain"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number"
                                 + (" (1.0: the mode's own numerics)" if name.endswith("_gain") else ""))
            object.__setattr__(self, name, float(value))  # one type per value: equal settings hash alike
        if not self.beta > 1.0:
            raise ValueError(f"beta={self.beta} must be > 1 (the published rule shifts a repeated maximum to beta x "
                             "max)")
        if not self.eps >= 0.0:
            raise ValueError(f"eps={self.eps} must be >= 0")
        problem = paper_block_keys_problem(self.paper_block_keys)
        if problem:
            raise ValueError(problem)
        if self.delta_sign not in DELTA_SIGNS:
            raise ValueError(f"delta_sign={self.delta_sign!r} is not one of {DELTA_SIGNS}")
        if self.output_sign not in DELTA_SIGNS:
            raise ValueError(f"output_sign={self.output_sign!r} is not one of {DELTA_SIGNS}")
        if self.delta_reference not in DELTA_REFERENCES:
            raise ValueError(f"delta_reference={self.delta_reference!r} is not one of {DELTA_REFERENCES}")
        check_heads(0, self.head_offset, self.total_heads)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if not isinstance(self.autotune, bool):
            raise TypeError(f"autotune={self.autotune!r} must be True (tuned tiles) or False (the fixed tiles)")
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"deterministic={self.deterministic!r} must be True (dQ in its own launch, "
                            "bit-reproducible) or False (dQ accumulated with atomics)")
        if self.out_fill is not None:
            if not _is_number(self.out_fill):
                raise TypeError(f"out_fill={self.out_fill!r} must be None (uninitialised outputs) or a number such "
                                "as nan")
            object.__setattr__(self, "out_fill", float(self.out_fill))

    @property
    def amplified(self) -> bool:
        """The delta-error stress path (``Numerics.amplified``)."""
        return self.delta_gain != 1.0 or self.delta_sign == "random"

    @property
    def keeps_fp32_output(self) -> bool:
        """The forward stores the FP32 normalised O (``Numerics.keeps_fp32_output``)."""
        return self.fix == "fp32_output" or (self.amplified and self.delta_reference == "fp32_output")

    @property
    def output_amplified(self) -> bool:
        """The forward-error stress path (``Numerics.output_amplified``)."""
        return self.output_gain != 1.0 or self.output_sign == "random"

    @property
    def needs_noise_keys(self) -> bool:
        """Whether the call draws random bits (fix=stochastic_output, random delta or output signs)."""
        return self.fix == "stochastic_output" or "random" in (self.delta_sign, self.output_sign)

    def numerics(self, head_dim: int, dtype: torch.dtype) -> Numerics:
        """The FP32 scalars of these settings for one head size and input dtype (shared by kernel and reference)."""
        return _numerics(self.rounding, self.fix, self.beta, self.eps, head_dim, dtype, self.paper_block_keys,
                         self.delta_gain, self.delta_sign, self.delta_reference, self.output_gain, self.output_sign)


@functools.lru_cache(maxsize=256)
def _numerics(rounding: str, fix: str, beta: float, eps: float, head_dim: int, dtype: torch.dtype,
              paper_block_keys: int, delta_gain: float = 1.0, delta_sign: str = "kept",
              delta_reference: str = "fp32_output", output_gain: float = 1.0,
              output_sign: str = "kept") -> Numerics:
    paper = rounding == "paper"
    sm_scale = _fp32(head_dim**-0.5)
    if fix == "dynamic_max":
        eps = max(eps, TIE_GAP.get(dtype, TIE_GAP[torch.bfloat16]))  # fp32 inputs are rounded to bf16
    exp_scale = _fp32(LOG2E) if paper else _fp32(head_dim**-0.5 * LOG2E)
    return Numerics(
        paper=paper,
        fix=FIX_CODE[fix],
        sm_scale=sm_scale,
        score_scale=sm_scale if paper else 1.0,
        exp_scale=exp_scale,
        shift_scale=1.0 if paper else _fp32(1.0 / exp_scale),
        beta=_fp32(beta),
        eps_cmp=_fp32(eps if paper else eps / sm_scale),
        paper_tile=paper_block_keys if paper else 0,
        delta_gain=_fp32(delta_gain),
        delta_random=delta_sign == "random",
        delta_exact_ref=delta_reference == "exact",
        output_gain=_fp32(output_gain),
        output_random=output_sign == "random",
        score_rounds_once=paper and dtype == torch.bfloat16 and math.frexp(sm_scale)[0] == 0.5,
    )


def check_noise_keys(noise_keys, batch: int, device: torch.device) -> None:
    """``noise_keys``: None (key 0 for every row) or an int64 tensor (batch,) on q's device, one key per batch row
    (values are used modulo 2**32; build them with kernels.rounding.row_keys / layer_keys)."""
    if noise_keys is None:
        return
    if not isinstance(noise_keys, torch.Tensor):
        raise TypeError(f"noise_keys must be an int64 tensor of shape ({batch},) or None; got {type(noise_keys)}")
    if noise_keys.dtype != torch.int64 or tuple(noise_keys.shape) != (batch,):
        raise ValueError(f"noise_keys must be int64 of shape ({batch},) (one key per batch row of this call); got "
                         f"{noise_keys.dtype} {tuple(noise_keys.shape)}")
    if noise_keys.device != device:
        raise ValueError(f"noise_keys is on {noise_keys.device} but q on {device}: move the keys to q's device")


def check_heads(heads: int, head_offset: int = 0, total_heads: int = 0) -> int:
    """Validate the global head numbering of a call that sees ``heads`` query heads; return the model's head count.

    The call's head h is the model's head ``head_offset + h`` of ``total_heads`` (0: ``heads``, i.e. not sharded).
    Head-dependent numerics (the safe dynamic_max shift) use the global index ``b * total_heads + head_offset + h``,
    so that a tensor-parallel rank holding a slice of the heads computes the same bits as one unsharded call.
    """
    for name, value in (("head_offset", head_offset), ("total_heads", total_heads)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int")
    if head_offset < 0:
        raise ValueError(f"head_offset={head_offset} must be >= 0 (the model index of this call's first q head)")
    if total_heads < 0:
        raise ValueError(f"total_heads={total_heads} must be >= 0 (the model's q heads; 0 means q.shape[1])")
    if total_heads == 0:
        if head_offset != 0:
            raise ValueError(f"head_offset={head_offset} needs total_heads (the model's number of q heads); "
                             "pass total_heads, or head_offset=0 for an unsharded call")
        return heads
    if head_offset + heads > total_heads:
        raise ValueError(f"head_offset={head_offset} + {heads} q heads exceeds total_heads={total_heads}: the local "
                         "heads must be a slice of the model's heads (lower head_offset or raise total_heads)")
    return total_heads


def check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
               allowed_dtypes: tuple[torch.dtype, ...], noise_keys: torch.Tensor | None = None) -> Numerics:
    """Validate one call's tensors against its settings (shapes, dtypes, the global head numbering through
    ``check_heads``, the noise keys; the settings themselves were checked when they were made); return the FP32
    scalars of the mode. Errors say what to change."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim); got shape {tuple(t.shape)}")
        if t.dtype not in allowed_dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; expected one of {allowed_dtypes}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    (b, h, t, d), (bk, hk, tk, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if (bk, tk, dk) != (b, t, d):
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)} in batch, seq or head_dim "
                         "(self-attention over one sequence length only)")
    if hk < 1 or h % hk:
        raise ValueError(f"q has {h} heads, k/v {hk}: grouped-query attention needs q heads divisible by k/v heads")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported; use 16, 32, 64 or 128")
    check_heads(h, settings.head_offset, settings.total_heads)
    if settings.fix == "stochastic_output" and q.dtype == torch.float16:
        raise ValueError("fix='stochastic_output' rounds O to bf16 (16 random bits below the bf16 mantissa): use bf16 "
                         "inputs, or another fix for fp16")
    check_noise_keys(noise_keys, b, q.device)
    return settings.numerics(d, q.dtype)
