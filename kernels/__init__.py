"""Flash attention with explicit, selectable rounding (Qiu & Yao, arXiv 2510.04212): Triton kernel and reference.

One settings record, ``AttentionSettings`` (kernels/modes.py), says what a call computes: rounding in ROUNDINGS x fix
in FIXES, the delta-error stress ``delta_gain`` / ``delta_sign`` (DELTA_SIGNS), the global head index, the backend
(BACKENDS) and the compiled kernels' launch options. ``attention(q, k, v, settings, noise_keys)`` is the one place
that picks the implementation for the settings and the device (``implementation``); ``saved_output`` returns the O
that the backward uses for delta = rowsum(dO * O). ``flash_attention`` and ``reference_attention`` take the
settings' fields instead of the record (the Triton kernel and the PyTorch reference by name). Noise keys:
``kernels.rounding.row_keys`` / ``layer_keys``. See docs/attention-kernel.md.

The Triton module is imported on first use, so that importing ``kernels`` needs no GPU and so that a test can set
TRITON_INTERPRET=1 before the kernels are defined.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import torch

from kernels import ops, reference
from kernels.modes import (BACKENDS, DELTA_SIGNS, FIXES, GLUON_AUTO_HEAD_DIMS, PAPER_BLOCK_KEYS, ROUNDINGS,
                           AttentionSettings, gluon_numerics)
from kernels.reference import reference_attention
from kernels.rounding import layer_keys, mix32, row_keys

__all__ = ["ROUNDINGS", "FIXES", "DELTA_SIGNS", "BACKENDS", "PAPER_BLOCK_KEYS", "AttentionSettings", "attention",
           "implementation", "describe", "flash_attention", "reference_attention", "saved_output", "mix32", "row_keys",
           "layer_keys", "tuning_record", "install_tuning"]

# The compiled implementations by backend name (module interface: kernels/ops.py); "reference" is kernels.reference.
_COMPILED = {"triton": "kernels.triton_flash", "gluon": "kernels.gluon_flash"}
_HOPPER: dict = {}  # CUDA device index -> compute capability 9.x


def _hopper(device: torch.device) -> bool:
    if device.index not in _HOPPER:
        _HOPPER[device.index] = torch.cuda.get_device_capability(device)[0] == 9
    return _HOPPER[device.index]


def implementation(settings: AttentionSettings, device: torch.device, head_dim: int | None = None) -> str:
    """The implementation that computes a call with ``settings`` on ``device``: the backend by name, or for
    backend=auto on CUDA the Gluon kernel where it is the faster one (a Hopper GPU, numerics it implements,
    head_dim 128: ``modes.GLUON_AUTO_HEAD_DIMS``; None: the head size is not known yet) and the Triton kernel
    otherwise, and the PyTorch reference of the same numerics elsewhere. A Gluon call it cannot run (strides,
    dtype) falls back to the Triton kernel inside kernels.gluon_flash, and says so once."""
    if settings.backend != "auto":
        return settings.backend
    if device.type != "cuda":
        return "reference"
    if gluon_numerics(settings) and (head_dim is None or head_dim in GLUON_AUTO_HEAD_DIMS) and _hopper(device):
        return "gluon"
    return "triton"


def compiled_module(name: str):
    """The module of a compiled implementation (imported on first use; see kernels/ops.py for its interface)."""
    return importlib.import_module(_COMPILED[name])


def tuning_record() -> dict:
    """The Triton kernel's autotuned tile choices in this process (``kernels.triton_flash.tuning_record``), part of a
    run's numerics and saved with its checkpoints; {} where the kernel never ran (CPU, the reference)."""
    module = sys.modules.get(_COMPILED["triton"])
    return module.tuning_record() if module is not None else {}


def install_tuning(record: dict | None) -> str:
    """Install a checkpoint's ``tuning_record`` before the first launch of a resumed process, so that it runs the
    recorded tiles (``kernels.triton_flash.install_tuning``); returns what it did in words, "" where there was
    nothing to do (an empty record, or no GPU: the CPU path runs the reference, which has no tiles)."""
    if not (record or {}).get("choices") or not torch.cuda.is_available():
        return ""
    return compiled_module("triton").install_tuning(record)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
              noise_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Attention O of (batch, heads, seq, head_dim) q, k, v with ``settings``, differentiable, by the implementation
    that ``implementation(settings, q.device, head_dim)`` names. k/v may have fewer heads (grouped-query attention).
    ``noise_keys``: int64 (batch,), one key per batch row (``kernels.rounding.layer_keys``; None: 0 for every row),
    used by fix=stochastic_output and random delta signs only.

    Triton (CUDA; CPU only under TRITON_INTERPRET=1, for tests): bf16 or fp16, O in the input dtype; under
    torch.compile the custom op ``sla_attention::flash_fwd`` (kernels/ops.py). Reference: also FP32 inputs, rounded
    to bf16 first (what BF16 autocast feeds attention), O in FP32 with bf16 values: the CPU training path.
    """
    name = implementation(settings, q.device, q.shape[-1])
    if name == "reference":
        return reference.attention(q, k, v, settings, noise_keys)
    return ops.attention(name, q, k, v, settings, noise_keys)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *fields,
                    noise_keys: torch.Tensor | None = None, **named) -> torch.Tensor:
    """The Triton kernel with ``AttentionSettings(*fields, **named)`` (positionally: causal, rounding, fix, beta,
    eps, ...), e.g. ``flash_attention(q, k, v, True, "paper", "dynamic_max", autotune=False)``; see ``attention``
    and ``AttentionSettings`` for the fields."""
    return attention(q, k, v, AttentionSettings(*fields, backend="triton", **named), noise_keys)


def saved_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings | None = None, *,
                 noise_keys: torch.Tensor | None = None, **named) -> torch.Tensor:
    """The O tensor whose rowsum(dO * O) is the backward's delta for ``settings`` (forward only, no graph), computed
    by the implementation ``attention`` would use. ``named`` fields replace the settings' (or make them, without
    ``settings``), e.g. ``saved_output(q, k, v, fix="fp32_output")``.

    LP O (input dtype; bf16 for FP32 inputs on the reference), the stochastically rounded O for
    fix=stochastic_output, or the FP32 O for fix=fp32_output. On the amplified delta path (delta_gain != 1 or
    delta_sign="random") the FP32 O_fp32 + delta_gain * s * (O_mode - O_fp32): delta is linear in O, so its delta is
    the backward's up to the FP32 rounding of the sums. The monitors pass the run's settings, so the O is computed
    with the tiles the run uses (``autotune``).
    """
    if settings is None:
        settings = AttentionSettings(**named)
    elif named:
        settings = dataclasses.replace(settings, **named)
    name = implementation(settings, q.device, q.shape[-1])
    if name == "reference":
        return reference.saved_output(q, k, v, settings, noise_keys)
    return ops.saved_output(name, q, k, v, settings, noise_keys)
