"""Conformance suite for attention kernels: the signed rounding error of O and of delta on crafted inputs.

    python -m kernels.conformance [--backend reference|triton|gluon] [--cases ties v1 negative long realistic]
                                  [--kernels NAME ...] [--rows N] [--long-keys N] [--inputs FILE.pt] [--seed S]
                                  [--out FILE.md]

What a team runs on its own kernel before a long run (issue 34): every numerics mode of this project (rounding x
fix, through ``kernels.attention`` on ``--backend``) and, where installed and runnable here, torch's SDPA (flash,
math and cuDNN backends), Transformer Engine's DotProductAttention and flash-attn, on bf16 inputs, against an FP64
softmax attention of the same inputs. One line per kernel; a kernel that is not installed or cannot run here gets a
line that says so (it is not measured, and the table does not pretend it was).

Per case and kernel two numbers, each a mean over query rows with a 95% confidence interval (+- 1.96 standard errors
of the per-row means):

- **O**: the error of O in bf16 ulps of the FP64 value (floored at the ulp of 1/8 of the row's RMS, so that a
  channel that cancels to ~0 is measured on the row's scale), signed toward magnitude (+: |O| too large), averaged
  over the row's channels: the paper's tie bias is a magnitude bias (larger |O| when a row's maximum repeats), which a
  plainly signed mean over channels of both signs would cancel.
- **delta**: the error of delta = rowsum(dO * O) in units of sum_c |dO_c| ulp(O_c) (signed; the same ulps). For this project's
  modes delta is the backward's own (``kernels.saved_output``: the FP32 O for fp32_output, rowsum(P * dP) /
  rowsum(P) for exact_delta); for the other kernels it is formed from the kernel's bf16 O, as an FA2-style backward
  forms it from its saved O.

Cases (inputs bf16, head_dim 64; ``--rows`` query rows per case):

- ``ties`` (k = 1..4): the tie-bias ``tile`` construction (kernels/tie_bias.py): rows whose maximum score is
  attained by k keys inside one 64-key tile, V in one binade per channel, dO with V's sign; non-causal.
- ``v1``: random q, k (scores ~N(0, 2^2)), V = 1 (the exact O is 1 and delta = rowsum(dO)); causal. A kernel whose numerator and
  denominator disagree (PV from bf16 P, l from FP32 P) shows here.
- ``negative``: the ``ties`` rows with every score shifted by -200 (a common -50 x 32 / 8 in one channel): very
  negative rows with repeated maxima. The published dynamic-max rule sets m = 0 there and underflows.
- ``long``: the tie-bias ``sink`` construction (ties anywhere in the row, the other keys' V closer to 0) at
  ``--long-keys`` keys; non-causal. The fa2 midpoint bias and paper's bf16 row sum show here.
- ``realistic``: synthetic rows shaped like a trained layer's (low-rank q and k around a shared mean, an attention
  sink at key 0 with small V, per-channel offsets of V and dO); causal. ``--inputs FILE.pt`` replaces it by
  captured tensors (a dict with q, k, v, d_out of shape (batch, heads, seq, head_dim); causal).

``bad rows`` counts rows with a NaN or inf in O, or an all-zero O where the exact one is not, over all cases. The
CPU table and the GPU command: docs/attention-kernel.md, "Conformance suite".
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from kernels.tie_bias import CASES as TIE_CASES
from kernels.tie_bias import build_inputs
from kernels.modes import FIXES, ROUNDINGS, AttentionSettings
from kernels.reference import exact_attention
from kernels.rounding import bf16_ulp

CASE_NAMES = ("ties", "v1", "negative", "long", "realistic")
MODES = tuple(f"{r}/{f}" for r in ROUNDINGS for f in FIXES)
EXACT = "bf16(exact)"
EXTERNAL = ("sdpa-flash", "sdpa-math", "sdpa-cudnn", "te", "flash-attn")
KERNELS = MODES + (EXACT,) + EXTERNAL
DIM = 64


@dataclass
class Inputs:
    """One case: bf16 q, k, v, dO (batch, heads, seq, 64), causal or not, and the row groups (column label -> bool
    mask over (batch, heads, seq)) its statistics are taken over."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    d_out: torch.Tensor
    causal: bool
    groups: dict


def _ties_inputs(rows: int, gen: torch.Generator, case=TIE_CASES["tile"]):
    q, k, v, d_out, row_ties = build_inputs(max(1, rows // case.seq), gen, case)
    return q, k, v, d_out, row_ties.unsqueeze(0)


def make_case(name: str, rows: int, seed: int, long_keys: int = 2048, inputs_file: str | None = None) -> Inputs:
    """The inputs of case ``name`` (see the module docstring), about ``rows`` query rows."""
    gen = torch.Generator().manual_seed(seed)
    if name == "ties":
        q, k, v, d_out, ties = _ties_inputs(rows, gen)
        return Inputs(q, k, v, d_out, False, {f"ties k={t}": ties == t for t in (1, 2, 3, 4)})
    if name == "negative":
        q, k, v, d_out, ties = _ties_inputs(rows, gen)
        q, k = q.clone(), k.clone()
        q[..., -1], k[..., -1] = 32.0, -50.0  # every score of a row shifted by -32 x 50 / 8 = -200, ties kept
        return Inputs(q, k, v, d_out, False, {"negative": torch.ones_like(ties, dtype=torch.bool)})
    if name == "long":
        case = replace(TIE_CASES["sink"], seq=long_keys)
        q, k, v, d_out, ties = _ties_inputs(max(rows, long_keys), gen, case)
        return Inputs(q, k, v, d_out, False, {"long": torch.ones_like(ties, dtype=torch.bool)})
    if name == "v1":
        seq = 256
        heads = max(1, rows // seq)
        q, k = (torch.randn(1, heads, seq, DIM, generator=gen) for _ in range(2))
        q = 2 * q  # scores ~N(0, 2^2): a few keys carry most of each row
        d_out = 1.0 + torch.rand(1, heads, seq, DIM, generator=gen)
        q, k, d_out = (t.bfloat16() for t in (q, k, d_out))
        v = torch.ones(1, heads, seq, DIM, dtype=torch.bfloat16)
        return Inputs(q, k, v, d_out, True, {"V=1": torch.ones(1, heads, seq, dtype=torch.bool)})
    if name == "realistic":
        if inputs_file:
            t = torch.load(inputs_file, map_location="cpu")
            q, k, v, d_out = (t[n].to(torch.bfloat16) for n in ("q", "k", "v", "d_out"))
            return Inputs(q, k, v, d_out, True, {"captured": torch.ones(q.shape[:-1], dtype=torch.bool)})
        return _realistic(rows, gen)
    raise ValueError(f"case {name!r} is not one of {CASE_NAMES}")


def _realistic(rows: int, gen: torch.Generator) -> Inputs:
    """Synthetic trained-layer-like rows: q and k in a rank-8 subspace around a shared mean (scores ~N(0, 2^2)), key 0
    a sink every query attends to (+6 over the mean score) with V about 0.1 of the others', V and dO with
    per-channel offsets of random sign (channels of one dominant sign, as trained layers have)."""
    seq = 512
    heads = max(1, rows // seq)
    basis = torch.randn(heads, 8, DIM, generator=gen) / math.sqrt(DIM)
    mean = torch.randn(heads, 1, DIM, generator=gen)
    k = (mean + torch.randn(heads, seq, 8, generator=gen) @ basis * 4 + 0.3 * torch.randn(heads, seq, DIM,
                                                                                      generator=gen))
    q = (torch.randn(heads, seq, 8, generator=gen) @ basis * 4 + 0.3 * torch.randn(heads, seq, DIM, generator=gen))
    sink = mean / mean.norm(dim=-1, keepdim=True)
    q = q + sink * 2.0
    k[:, 0] = k[:, 0] + sink[:, 0] * 3.0 * math.sqrt(DIM)  # q.k at key 0 gains ~ 2 x 3 x 8 / 8 = +6 after scaling
    offset = torch.randn(heads, 1, DIM, generator=gen)
    v = offset + 0.5 * torch.randn(heads, seq, DIM, generator=gen)
    v[:, 0] = 0.1 * v[:, 0]
    d_out = torch.sign(offset) * 0.5 + torch.randn(heads, seq, DIM, generator=gen)
    as_bf16 = lambda t: t.unsqueeze(0).to(torch.bfloat16)  # noqa: E731 - (1, heads, seq, 64)
    q, k, v, d_out = (as_bf16(t) for t in (q, k, v, d_out))
    return Inputs(q, k, v, d_out, True, {"realistic": torch.ones(1, heads, seq, dtype=torch.bool)})


class Skip(Exception):
    """A kernel that is not installed or cannot run here (its line says why)."""


def _external(name: str, q, k, v, causal: bool) -> torch.Tensor:
    """O of a kernel that is not this project's, (batch, heads, seq, dim) in bf16."""
    if name.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if name == "sdpa-cudnn" and q.device.type != "cuda":
            raise Skip("needs CUDA")
        backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-math": SDPBackend.MATH,
                   "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[name]
        try:
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        except RuntimeError as err:
            raise Skip(f"torch cannot run it here ({str(err).splitlines()[0][:80]})") from None
    if q.device.type != "cuda":
        raise Skip("needs CUDA")
    if name == "te":
        if importlib.util.find_spec("transformer_engine") is None:
            raise Skip("transformer_engine not installed")
        import transformer_engine.pytorch as te

        heads, dim = q.shape[1], q.shape[3]
        layer = te.DotProductAttention(heads, dim, attn_mask_type="causal" if causal else "no_mask",
                                       qkv_format="bshd")
        out = layer(*(t.transpose(1, 2).contiguous() for t in (q, k, v)))  # (batch, seq, heads * dim)
        return out.view(q.shape[0], q.shape[2], heads, dim).transpose(1, 2)
    if name == "flash-attn":
        if importlib.util.find_spec("flash_attn") is None:
            raise Skip("flash_attn not installed")
        from flash_attn import flash_attn_func

        out = flash_attn_func(*(t.transpose(1, 2).contiguous() for t in (q, k, v)), causal=causal)
        return out.transpose(1, 2)
    raise ValueError(f"kernel {name!r} is not one of {KERNELS}")


def outputs(name: str, inputs: Inputs, backend: str, o_exact: torch.Tensor, autotune: bool = True):
    """(O the kernel returns, O whose rowsum with dO is its delta) on the case's inputs."""
    import kernels

    q, k, v = inputs.q, inputs.k, inputs.v
    if name == EXACT:
        out = o_exact.to(torch.bfloat16)
        return out, out
    if name in EXTERNAL:
        out = _external(name, q, k, v, inputs.causal)
        return out, out
    rounding, fix = name.split("/")
    settings = AttentionSettings(causal=inputs.causal, rounding=rounding, fix=fix, backend=backend,
                                 autotune=autotune)
    if backend == "gluon":  # only the modes the Hopper kernel takes: the others would be the Triton kernel's rows
        from kernels import gluon_flash, triton_flash

        why = gluon_flash.unsupported(q, k, v, triton_flash.prepare(q, k, v, settings))
        if why:
            raise Skip(f"not a Gluon mode: {why}")
    with torch.no_grad():
        out = kernels.attention(q, k, v, settings)
        saved = kernels.saved_output(q, k, v, settings) if fix in ("fp32_output", "exact_delta") else out
    return out, saved


def measure(name: str, inputs: Inputs, backend: str, o_exact: torch.Tensor, autotune: bool = True) -> dict:
    """{group label: (O mean, O half-width, delta mean, delta half-width, rows)} and 'bad_rows' for one kernel."""
    out, saved = outputs(name, inputs, backend, o_exact, autotune)
    out, saved, ref, dof = (t.double().cpu() for t in (out, saved, o_exact, inputs.d_out))
    # ulps of the exact value, floored at the ulp of 1/8 of the row's RMS: a channel that cancels to ~0 counts in
    # the units of the row's scale (its own ulp would make any absolute error a huge number of ulps)
    floor = ref.square().mean(-1, keepdim=True).sqrt() / 8
    ulp = bf16_ulp(torch.maximum(ref.abs(), floor))
    o_err = (torch.sign(ref) * (out - ref) / ulp).mean(-1)  # per row, toward magnitude
    d_err = ((saved - ref) * dof).sum(-1) / (dof.abs() * ulp).sum(-1)
    bad = ~torch.isfinite(out).all(-1) | ((out == 0).all(-1) & (ref != 0).any(-1))
    result = {"bad_rows": int(bad.sum())}
    for label, rows in inputs.groups.items():
        rows = rows & ~bad
        result[label] = (*_mean_ci(o_err[rows]), *_mean_ci(d_err[rows]), int(rows.sum()))
    return result


def _mean_ci(x: torch.Tensor) -> tuple[float, float]:
    n = x.numel()
    if n == 0:
        return math.nan, math.nan
    half = 1.96 * x.std().item() / math.sqrt(n) if n > 1 else math.inf
    return x.mean().item(), half


def run(cases, kernels_, backend: str = "reference", rows: int = 2048, seed: int = 0, long_keys: int = 2048,
        inputs_file: str | None = None, autotune: bool = True, progress=None) -> dict:
    """{case: {kernel: result dict | 'skipped: ...' | 'error: ...'}} and the column labels per case."""
    device = "cuda" if (backend in ("triton", "gluon") or any(n in EXTERNAL for n in kernels_)) and torch.cuda.is_available() \
        else "cpu"
    results, columns = {}, {}
    for case in cases:
        inputs = make_case(case, rows, seed, long_keys, inputs_file)
        inputs.q, inputs.k, inputs.v, inputs.d_out = (t.to(device) for t in (inputs.q, inputs.k, inputs.v,
                                                                             inputs.d_out))
        o_exact = exact_attention(inputs.q, inputs.k, inputs.v, inputs.causal)[0]
        columns[case] = list(inputs.groups)
        results[case] = {}
        for name in kernels_:
            t0 = time.time()
            try:
                results[case][name] = measure(name, inputs, backend, o_exact, autotune)
            except Skip as why:
                results[case][name] = f"skipped: {why}"
            except Exception as err:  # noqa: BLE001 - a kernel that fails is reported, not hidden
                results[case][name] = f"error: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
            if progress:
                progress(f"[{case}] {name}: {time.time() - t0:.1f} s")
    return {"results": results, "columns": columns, "device": device}


def _cell(values) -> str:
    o, o_ci, d, d_ci, n = values
    if not n:
        return "-"
    return f"{o:+.3f}±{o_ci:.3f} / {d:+.3f}±{d_ci:.3f}"


def to_markdown(run_result: dict, backend: str, rows: int, seed: int, command: str) -> str:
    results, columns = run_result["results"], run_result["columns"]
    labels = [c for case in results for c in columns[case]]
    kernels_ = list(next(iter(results.values())))
    lines = [f"Conformance: `{command}` (backend={backend}, device={run_result['device']}, ~{rows} rows per case, "
             f"seed {seed}). Cells: O error / delta error, mean ± 95% CI over rows; O in bf16 ulps toward "
             "magnitude (+: |O| too large), delta in units of sum_c |dO_c| ulp(O_c).", "",
             "| kernel | " + " | ".join(labels) + " | bad rows |", "|---|" + "---|" * (len(labels) + 1)]
    for name in kernels_:
        per_case = [results[case][name] for case in results]
        text = next((r for r in per_case if isinstance(r, str)), None)
        if text is not None and all(isinstance(r, str) for r in per_case):
            lines.append(f"| {name} | {text} |" + " |" * len(labels))
            continue
        cells, bad = [], 0
        for case, r in zip(results, per_case):
            if isinstance(r, str):
                cells += [r] * len(columns[case])
            else:
                cells += [_cell(r[label]) for label in columns[case]]
                bad += r["bad_rows"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {bad} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.conformance", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference", choices=("reference", "triton", "gluon"),
                        help="what runs this project's modes: the PyTorch reference, the Triton kernel (CUDA; "
                             "without CUDA the interpreter, slow), or the Gluon Hopper kernel (an sm_90 GPU; "
                             "modes it does not take are skipped)")
    parser.add_argument("--cases", nargs="+", default=list(CASE_NAMES), choices=CASE_NAMES)
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, metavar="NAME",
                        help=f"default: all of {', '.join(KERNELS)}")
    parser.add_argument("--rows", type=int, default=2048, help="query rows per case (default 2048)")
    parser.add_argument("--long-keys", type=int, default=2048, help="keys per row of the long case (default 2048)")
    parser.add_argument("--inputs", default=None, help="a torch.save'd dict of q, k, v, d_out for the realistic case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixed-tiles", action="store_true", help="--backend triton: the fixed 64 x 64 tiles")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.long_keys < 64:
        parser.error("--rows must be >= 1 and --long-keys >= 64")
    if args.inputs and not os.path.isfile(args.inputs):
        parser.error(f"--inputs: no file {args.inputs}")
    if args.backend == "gluon" and not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        parser.error("--backend gluon needs a Hopper GPU (sm_90); use --backend triton or reference here")
    if args.backend == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print("no CUDA device: running the Triton kernel under TRITON_INTERPRET=1 (slow)", file=sys.stderr)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    result = run(args.cases, args.kernels, args.backend, args.rows, args.seed, args.long_keys, args.inputs,
                 not args.fixed_tiles, progress)
    command = "python -m kernels.conformance " + " ".join(argv if argv is not None else sys.argv[1:])
    table = to_markdown(result, args.backend, args.rows, args.seed, command.strip())
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
