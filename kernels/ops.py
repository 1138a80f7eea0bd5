"""The compiled attention implementations as differentiable torch functions: one route for all of them.

A compiled implementation (``kernels.triton_flash`` today; chosen by name through ``kernels.compiled_module``) is a
module with

- ``prepare(q, k, v, settings, noise_keys) -> Numerics``: checks the call;
- ``forward(q, k, v, settings, nm, noise_keys) -> (O, LSE, O32, O_mode)``: O in the input dtype, LSE (B, H, T)
  FP32, the FP32 O where ``settings.keeps_fp32_output``, the mode's own O under the output stress
  (``settings.output_amplified``: O is then the amplified one), else empty tensors;
- ``backward(d_out, q, k, v, o_saved, lse, o32, settings, nm, noise_keys) -> (dq, dk, dv)``;
- ``forward_outputs(q, settings)``, ``backward_outputs(q, k, v, settings)``: the tensors those allocate (the fake
  kernels that torch.compile traces with).

Eager calls go through a plain ``autograd.Function`` (least host time: the numerics are checked once per step).
Under ``torch.compile`` the call is the custom op ``sla_attention::flash_fwd`` (backward ``sla_attention::flash_bwd``),
opaque to the compiler. Custom ops take primitives only, so both ops take the implementation's name and the fields
of ``AttentionSettings`` one by one; their schema is generated from the dataclass, so a new setting needs no edit
here. Both routes run the same launches and give the same bits.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import torch

from kernels.modes import KEY_TILE, AttentionSettings
from kernels.reference import _expand_kv, effective_output, exact_output

FIELDS = tuple(f.name for f in dataclasses.fields(AttentionSettings))  # the custom ops' settings arguments, in order


def _module(name: str):
    from kernels import compiled_module  # the package's one table of implementations

    return compiled_module(name)


def settings_fields(settings: AttentionSettings) -> tuple:
    """The settings as the custom ops take them: the values of FIELDS (``AttentionSettings(*fields)`` inverts it)."""
    return tuple(getattr(settings, name) for name in FIELDS)


def _saved(settings: AttentionSettings, q, k, v, out, lse, o32, o_mode, noise_keys) -> tuple:
    """What the backward needs: delta_mode's O (the FP32 O for fp32_output, else the mode's O: the returned one, or
    under the output stress the one kept beside it) and, on the amplified delta path only, the FP32 O of delta_fp32
    and the noise keys of random signs."""
    o_mode = o32 if settings.fix == "fp32_output" else o_mode if settings.output_amplified else out
    if settings.amplified:
        return q, k, v, o_mode, lse, o32, noise_keys
    return q, k, v, o_mode, lse, None, None


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, name: str, settings: AttentionSettings, noise_keys):
        module = _module(name)
        nm = module.prepare(q, k, v, settings, noise_keys)
        out, lse, o32, o_mode = module.forward(q, k, v, settings, nm, noise_keys)
        ctx.save_for_backward(*_saved(settings, q, k, v, out, lse, o32, o_mode, noise_keys))
        ctx.module, ctx.settings, ctx.nm = module, settings, nm
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, o_saved, lse, o32, noise_keys = ctx.saved_tensors
        dq, dk, dv = ctx.module.backward(d_out, q, k, v, o_saved, lse, o32, ctx.settings, ctx.nm, noise_keys)
        return dq, dk, dv, None, None, None


def _schema_type(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (base,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _schema_type(base) + "?"
    return {bool: "bool", int: "int", float: "float", str: "str"}[hint]


_HINTS = typing.get_type_hints(AttentionSettings)
_SETTINGS_SCHEMA = ", ".join(f"{_schema_type(_HINTS[name])} {name}" for name in FIELDS)


def _flash_fwd(q, k, v, noise_keys, implementation, *fields):
    module = _module(implementation)
    settings = AttentionSettings(*fields)
    return module.forward(q, k, v, settings, module.prepare(q, k, v, settings, noise_keys), noise_keys)


def _flash_bwd(d_out, q, k, v, o_saved, lse, o32, noise_keys, implementation, *fields):
    module = _module(implementation)
    settings = AttentionSettings(*fields)
    nm = module.prepare(q, k, v, settings, noise_keys)
    return module.backward(d_out, q, k, v, o_saved, lse, o32, settings, nm, noise_keys)


flash_fwd = torch.library.custom_op(
    "sla_attention::flash_fwd", _flash_fwd, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? noise_keys, str implementation, {_SETTINGS_SCHEMA}) "
           "-> (Tensor, Tensor, Tensor, Tensor)")
flash_fwd.__doc__ = """Forward: (O, LSE, FP32 O, the mode's O; empty where not kept) of ``implementation`` with the
settings' fields."""
flash_bwd = torch.library.custom_op(
    "sla_attention::flash_bwd", _flash_bwd, mutates_args=(),
    schema=f"(Tensor d_out, Tensor q, Tensor k, Tensor v, Tensor o_saved, Tensor lse, Tensor? o32, Tensor? noise_keys, "
           f"str implementation, {_SETTINGS_SCHEMA}) -> (Tensor, Tensor, Tensor)")
flash_bwd.__doc__ = """Backward: (dq, dk, dv); ``o_saved`` is the O that delta uses, ``o32`` the forward's FP32 O (the
amplified delta path only)."""


@flash_fwd.register_fake
def _(q, k, v, noise_keys, implementation, *fields):
    return _module(implementation).forward_outputs(q, AttentionSettings(*fields))


@flash_bwd.register_fake
def _(d_out, q, k, v, o_saved, lse, o32, noise_keys, implementation, *fields):
    return _module(implementation).backward_outputs(q, k, v, AttentionSettings(*fields))


def _setup_context(ctx, inputs, output):
    q, k, v, noise_keys, implementation, *fields = inputs
    out, lse, o32, o_mode = output
    ctx.save_for_backward(*_saved(AttentionSettings(*fields), q, k, v, out, lse, o32, o_mode, noise_keys))
    ctx.implementation, ctx.fields = implementation, fields


def _backward_rule(ctx, d_out, _d_lse, _d_o32, _d_o_mode):
    q, k, v, o_saved, lse, o32, noise_keys = ctx.saved_tensors
    dq, dk, dv = flash_bwd(d_out, q, k, v, o_saved, lse, o32, noise_keys, ctx.implementation, *ctx.fields)
    return dq, dk, dv, None, None, *([None] * len(ctx.fields))


flash_fwd.register_autograd(_backward_rule, setup_context=_setup_context)


def attention(implementation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, settings: AttentionSettings,
              noise_keys: torch.Tensor | None = None) -> torch.Tensor:
    """O of the compiled ``implementation``, differentiable: the custom op while torch.compile traces, else the
    eager autograd function (same launches, same bits)."""
    if torch.compiler.is_compiling():
        return flash_fwd(q, k, v, noise_keys, implementation, *settings_fields(settings))[0]
    return _EagerAttention.apply(q, k, v, implementation, settings, noise_keys)


def saved_output(implementation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 settings: AttentionSettings, noise_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The O whose rowsum(dO * O) is the implementation's delta (forward only, no autograd graph; see
    ``kernels.saved_output``)."""
    module = _module(implementation)
    nm = module.prepare(q, k, v, settings, noise_keys)
    with torch.no_grad():
        out, lse, o32, o_mode = module.forward(q, k, v, settings, nm, noise_keys)
        if nm.output_amplified:  # the O delta uses is the mode's, not the returned one
            out = o_mode
        o_exact = None
        if nm.exact_pass:  # P V with the backward's P, recomputed from this kernel's LSE
            heads = q.shape[1]
            o_exact = exact_output(q, _expand_kv(k, heads), _expand_kv(v, heads), lse, settings.causal, nm, KEY_TILE)
        return effective_output(out, o32 if nm.keeps_fp32_output else None, nm, noise_keys, settings.head_offset,
                                o_exact)
