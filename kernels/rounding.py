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


def _mix32(key: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors (values in [0, 2^32)); the kernel has the same steps."""
    key = (((key >> 16) ^ key) * _MIX_MULT) & _MASK32
    key = (((key >> 16) ^ key) * _MIX_MULT) & _MASK32
    return (key >> 16) ^ key


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
