"""Explicit rounding points shared by the PyTorch reference and the Triton kernel.

Every place where flash attention rounds to the low-precision (LP) input dtype goes through ``round_lp``: an FP32
tensor in, an FP32 tensor of LP-representable values out, rounded to nearest with ties to even (RNE). For bf16 the
rounding is done on the FP32 bit pattern (add 0x7FFF plus the lowest kept bit, clear the low 16 bits), exactly as the
kernel does it under the Triton interpreter, whose own fp32 -> bf16 cast truncates. For fp16 the plain cast is used:
it is RNE in PyTorch, in numpy (the interpreter) and on the GPU.

This module also holds the per-row shift of the safe ``dynamic_max`` fix (``safe_shift``): a pure function of the
row index, the global (batch, head) index b * total_heads + head_offset + h (the model's head numbering, so that a
tensor-parallel slice of the heads hashes like the unsharded call) and the bits of the tile's row maximum, computed
with integer arithmetic so that kernel and reference agree bit for bit.
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

LP_DTYPES = (torch.bfloat16, torch.float16)

# Safe dynamic_max: the shift delta lies in [SHIFT_LO, SHIFT_LO + 0.5) in the exponent units of the mode (bits for
# rounding=fa2, which exponentiates with exp2; nats for rounding=paper). SHIFT_LO keeps the largest P_bar at most
# 2**-(1/64) = 0.989 (fa2) or e**-(1/64) = 0.984 (paper), which rounds below 1 in bf16 (whose spacing below 1 is
# 2**-8) and in fp16. The upper end bounds how far below 1 the largest term can go (>= 0.70), so it never underflows.
SHIFT_LO = 2.0**-6
SHIFT_STEP = 2.0**-17  # 16 hash bits -> [0, 0.5): delta = SHIFT_LO + u * SHIFT_STEP is exact in fp32
_MASK32 = 0xFFFFFFFF
_ROW_MULT = 0x9E3779B1  # odd 32-bit constants (golden ratio, murmur3 finaliser) to spread row and head indices
_BH_MULT = 0x85EBCA77
_MIX_MULT = 0x045D9F3B


def rne_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round an FP32 tensor to the nearest bf16 value (ties to even); returns FP32. NaN stays NaN, overflow -> inf."""
    if x.dtype != torch.float32:
        raise TypeError(f"rne_bf16 takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    lsb = (bits >> 16) & 1
    rounded = ((bits + (0x7FFF + lsb)) & -65536).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def round_lp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round FP32 ``x`` to ``dtype`` (bf16 or fp16) with RNE, keeping FP32 storage; ``float32`` leaves x unchanged."""
    if dtype == torch.bfloat16:
        return rne_bf16(x)
    if dtype == torch.float16:
        return x.to(torch.float16).to(torch.float32)
    if dtype == torch.float32:
        return x
    raise TypeError(f"no rounding to {dtype}; low-precision dtypes are bf16 and fp16")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (the ulp used to express errors), as float64; subnormal-safe for |x| >= 2^-126."""
    x = x.double().abs().clamp_min(2.0**-126)
    exponent = torch.floor(torch.log2(x))
    # log2 of a value just below a power of two can round up to it: fix the exponent so 2^e <= |x| < 2^(e+1)
    exponent = torch.where(torch.exp2(exponent) > x, exponent - 1, exponent)
    return torch.exp2(exponent - 7)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (two multiply-xorshift rounds, a bijection of [0, 2^32)) on int64 tensors with
    values in [0, 2^32); returns int64 in [0, 2^32). The kernel runs the same steps in uint32 (``_mix32``)."""
    x = (((x >> 16) ^ x) * _MIX_MULT) & _MASK32
    x = (((x >> 16) ^ x) * _MIX_MULT) & _MASK32
    return (x >> 16) ^ x


_mix32 = mix32  # the name safe_shift has always used


def _mix32_int(x: int) -> int:
    """``mix32`` of one Python int (the scalar part of ``row_keys``, computed on the host)."""
    x &= _MASK32
    x = (((x >> 16) ^ x) * _MIX_MULT) & _MASK32
    x = (((x >> 16) ^ x) * _MIX_MULT) & _MASK32
    return (x >> 16) ^ x


# Noise keys (delta_sign="random", fix="stochastic_output"). Every field is folded in as mix32(h + (x + 1) * C):
# the + 1 keeps an all-zero input away from mix32's fixed point 0, distinct odd C per field keep fields apart.
_SEED_MULT = 0x2C1B3C6D
_STEP_MULT = 0x297A2D39
_KEY_ROW_MULT = 0x9E3779B1
_LAYER_MULT = 0x7FEB352D
_HEAD_MULT = 0x85EBCA77
_POS_MULT = 0xC2B2AE3D
_CHANNEL_MULT = 0x27D4EB2F
_SIGN_SALT = 0x68E31DA4  # delta_sign="random"
OUTPUT_SIGN_SALT = 0x2C1B3C6D  # output_sign="random": signs independent of the delta's
_LOW16 = 0xFFFF


def _fold_int(h: int, x: int, mult: int) -> int:
    return _mix32_int(h + ((x + 1) * mult))


def _fold(h: torch.Tensor, x, mult: int) -> torch.Tensor:
    return mix32((h + (((x + 1) * mult) & _MASK32)) & _MASK32)


def row_keys(seed: int, step: int, rows: torch.Tensor) -> torch.Tensor:
    """Noise key of each global batch row of one optimizer step: int64 (len(rows),) in [0, 2^32).

    ``rows``: the rows' indices in the step's global batch (``BatchSchedule.offsets(step)`` order:
    i*dp*mb + r*mb + j for accumulation step i, data-parallel rank r, micro-batch row j), so that the key of a
    sequence does not depend on how the batch is split over ranks and micro-batches. ``seed`` and ``step`` are Python
    ints (any size; both 32-bit halves are folded in) and are hashed on the host, so call this outside compiled code
    (or expect one recompilation per step); ``layer_keys`` is pure tensor arithmetic and compiles."""
    for name, value in (("seed", seed), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be a Python int")
    if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
        raise TypeError("rows must be a 1-d integer tensor of global batch-row indices")
    h = 0
    for value, mult in ((seed, _SEED_MULT), (step, _STEP_MULT)):
        h = _fold_int(h, value & _MASK32, mult)
        h = _fold_int(h, (value >> 32) & _MASK32, mult)
    return _fold(torch.full_like(rows, h, dtype=torch.int64), rows.to(torch.int64), _KEY_ROW_MULT)


def layer_keys(row_keys: torch.Tensor, layer: int) -> torch.Tensor:
    """The row keys of one layer (global layer index ``layer``): what ``noise_keys`` of that layer's attention
    receives. Pure int64 tensor arithmetic: same values on CPU and CUDA, fine under torch.compile."""
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise TypeError(f"layer={layer!r} must be a non-negative int (the model's global layer index)")
    return _fold(row_keys.to(torch.int64) & _MASK32, layer, _LAYER_MULT)


def noise_row_hash(keys: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Hash of (row key, global head, query position), broadcast; int64 in [0, 2^32). The kernel's ``_row_hash``
    computes the same bits in uint32."""
    return _fold(_fold(keys.to(torch.int64) & _MASK32, heads.to(torch.int64), _HEAD_MULT), positions.to(torch.int64),
                 _POS_MULT)


def random_signs(row_hash: torch.Tensor, salt: int = _SIGN_SALT) -> torch.Tensor:
    """delta_sign="random" (output_sign with OUTPUT_SIGN_SALT): s = -1 where the top bit of mix32(row hash ^ salt)
    is set, else +1 (FP32)."""
    negative = (mix32(row_hash ^ salt) >> 31) == 1
    return torch.where(negative, torch.full(row_hash.shape, -1.0, device=row_hash.device),
                       torch.ones(row_hash.shape, device=row_hash.device))


def sr_bits(row_hash: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """16 random bits per element from (row hash, channel), int64 in [0, 2^16)."""
    return _fold(row_hash, channels.to(torch.int64), _CHANNEL_MULT) & _LOW16


def sr_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of FP32 ``x`` to bf16 with 16 random bits per element; returns FP32 (bf16 values).

    Adds ``bits`` (in [0, 2^16)) to the FP32 bit pattern and clears the low 16 bits: the magnitude rounds up with
    probability (dropped bits) / 2^16, so E[SR(x)] = x over uniform bits. Exact bf16 values stay unchanged, NaN stays
    NaN, a finite value may round up to inf only beyond the largest bf16 value. Computed in int64 masked to 32 bits,
    the uint32 arithmetic of the kernel's ``_sr_bf16``."""
    if x.dtype != torch.float32:
        raise TypeError(f"sr_bf16 takes float32, got {x.dtype}")
    pattern = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    rounded = ((pattern + bits) & 0xFFFF0000)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, rounded)


def stochastic_bf16(o32: torch.Tensor, noise_keys: torch.Tensor | None, head_offset: int = 0) -> torch.Tensor:
    """fix=stochastic_output: SR of an FP32 O (batch, heads, seq, dim) to bf16 (FP32 storage), keyed by (noise key of
    the batch row, global head head_offset + h, query position, channel). ``noise_keys`` None: key 0 for every row."""
    bsz, heads, seq, dim = o32.shape
    dev = o32.device
    keys = torch.zeros(bsz, dtype=torch.int64, device=dev) if noise_keys is None else noise_keys
    rh = noise_row_hash(keys.view(bsz, 1, 1), torch.arange(heads, device=dev).view(1, heads, 1) + head_offset,
                        torch.arange(seq, device=dev).view(1, 1, seq))
    return sr_bf16(o32, sr_bits(rh.unsqueeze(-1), torch.arange(dim, device=dev)))


def delta_signs(shape, noise_keys: torch.Tensor | None, head_offset: int, device,
                salt: int = _SIGN_SALT) -> torch.Tensor:
    """delta_sign="random": s (batch, heads, seq) of +-1 (FP32) per (noise key of the row, global head, position);
    ``salt`` OUTPUT_SIGN_SALT: the signs of output_sign="random"."""
    bsz, heads, seq = shape
    keys = torch.zeros(bsz, dtype=torch.int64, device=device) if noise_keys is None else noise_keys
    rh = noise_row_hash(keys.view(bsz, 1, 1), torch.arange(heads, device=device).view(1, heads, 1) + head_offset,
                        torch.arange(seq, device=device).view(1, 1, seq))
    return random_signs(rh, salt)


def safe_shift(row_max: torch.Tensor, rows: torch.Tensor, bh: torch.Tensor) -> torch.Tensor:
    """Shift delta of the safe ``dynamic_max`` fix for each row of a score tile.

    ``row_max``: FP32 row maxima of the tile (any shape); ``rows``: global query indices and ``bh``: global
    (batch, head) indices b * total_heads + head_offset + h, both broadcastable to ``row_max``. Returns FP32 delta
    in [SHIFT_LO, SHIFT_LO + 0.5), a pseudo-random function of (bh, row, bf16 bits of the row maximum): it varies
    from row to row and step to step, so the rounding of the shifted P_bar does not lean the same way in every row
    (a single fixed offset would).
    """
    rm = torch.where(row_max == 0, torch.zeros_like(row_max), row_max)  # -0.0 and 0.0 hash alike
    rbits = ((rne_bf16(rm).view(torch.int32) >> 16) & 0xFFFF).to(torch.int64)
    key = rbits ^ ((rows.to(torch.int64) * _ROW_MULT) & _MASK32) ^ ((bh.to(torch.int64) * _BH_MULT) & _MASK32)
    u = (_mix32(key) & 0xFFFF).to(torch.float32)
    return u * SHIFT_STEP + SHIFT_LO
