"""Tie bias: the signed rounding error of O and of delta = rowsum(dO * O) on rows with k tied maxima.

    python -m kernels.tie_bias [--backend reference|triton] [--case tile|spread|dominant|sink ...]
                               [--paper-block-keys N ...] [--sequences N] [--seed S] [--fixed-tiles]
                               [--out FILE.md]

Common construction (bf16, head_dim 64, non-causal). Each sequence has seq/16 anchor keys, split evenly over the
case's tie counts k; anchor g is a random key vector (norm 8) copied to k positions, so its k scores are exactly
equal for every query. Every query row belongs to one anchor: q = s * anchor + noise (other keys ~N(0, 0.25)), so
the tied scores (8 s) lead the others. V has 32 sign-imbalanced channels (every value in [-2, -1): same sign, same
exponent, as in the paper's worked example) and 32 control channels (magnitudes alike, one random sign per sequence
and channel). dO has the sign of V in every channel.

Cases (``CASES``):

- ``tile``: 256 keys, copies inside one 64-key tile (one 64-aligned tile lies inside one tile of every kernel
  configuration: the paper's mechanism), s = 1.5 (the other keys hold ~2e-3 of the weight).
- ``spread``: 1024 keys, copies at random positions (mostly in different tiles), s = 1.5.
- ``dominant``: 256 keys, k = 1 only, s uniform in [1.25, 2.5): one key takes all but 1e-2 .. 1e-6 of the weight,
  so the authors' bf16 row sum l rounds to exactly 1 in most rows.
- ``sink``: as ``spread`` with s = 2 and sink-like V: the keys that are not anchor copies carry V scaled by 1/4
  (same signs, closer to 0), so the other keys pull O toward 0 in every row (see docs/attention-kernel.md, "Tie bias
  of the fa2 numerics").

Reported per case, mode and k: the mean signed error of O against an fp64 reference of the same bf16 inputs, in bf16
ulps of the reference value, for the imbalanced and the control channels; the mean error of delta (from the O that
the mode's backward uses) in units of sum_c |dO_c| ulp(O_c); NaN rows and zeroed rows (O all zero where the exact O
is not). The theory for paper/none in the tile case is -1/4, -1/6, -1/8 ulp of O for k = 2, 3, 4 (a magnitude bias)
and the opposite sign for delta. ``bf16(exact)`` is the fp64 O rounded once to bf16: what any kernel that rounds a
correct O once to nearest gets. On CUDA the table adds torch's SDPA flash and cuDNN backends (delta from their bf16 O).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

from kernels.modes import FIXES, KEY_TILE, PAPER_BLOCK_KEYS, mode_kwargs, paper_block_keys_problem
from kernels.reference import exact_attention
from kernels.rounding import bf16_ulp

TIE_COUNTS = (1, 2, 3, 4)
THEORY_PAPER_NONE = {1: 0.0, 2: -1 / 4, 3: -1 / 6, 4: -1 / 8}
DIM = 64
ROWS_PER_ANCHOR = 16  # anchors per sequence = seq // ROWS_PER_ANCHOR
IMBALANCED = slice(0, DIM // 2)
CONTROL = slice(DIM // 2, DIM)
EXACT = "bf16(exact)"
SDPA_BACKENDS = {"sdpa/flash": "FLASH_ATTENTION", "sdpa/cudnn": "CUDNN_ATTENTION"}


@dataclass(frozen=True)
class Case:
    """One construction of tied rows (see the module docstring)."""

    seq: int
    tie_counts: tuple[int, ...]
    spread: bool  # copies anywhere in the row (else inside one KEY_TILE-aligned tile)
    query_scale: tuple[float, float]  # s drawn uniformly from [lo, hi) per row (one value when lo == hi)
    background_v: float  # factor on V of the keys that are not anchor copies


CASES = {
    "tile": Case(256, TIE_COUNTS, False, (1.5, 1.5), 1.0),
    "spread": Case(1024, TIE_COUNTS, True, (1.5, 1.5), 1.0),
    "dominant": Case(256, (1,), False, (1.25, 2.5), 1.0),
    "sink": Case(1024, TIE_COUNTS, True, (2.0, 2.0), 0.25),
}
BASE_SEQ = 256  # --sequences counts sequences of this length; longer cases use fewer, for the same number of rows


@dataclass(frozen=True)
class Mode:
    """A numerics mode of this project's kernels; ``paper_block_keys`` None leaves the kernels' default."""

    rounding: str
    fix: str
    paper_block_keys: int | None = None

    @property
    def label(self) -> str:
        tile = "" if self.paper_block_keys is None else f"@{self.paper_block_keys or 'row'}"
        return f"{self.rounding}{tile}/{self.fix}"

    def kwargs(self) -> dict:
        return mode_kwargs(self.rounding, self.fix, self.paper_block_keys)


def default_modes(paper_block_keys=(None,)) -> list[Mode]:
    """Every fix in fa2 rounding (tile-size independent), every fix in paper rounding at each paper tile size."""
    return [Mode("fa2", f) for f in FIXES] + [Mode("paper", f, n) for n in paper_block_keys for f in FIXES]


def build_inputs(sequences: int, generator: torch.Generator, case: Case = CASES["tile"]):
    """q, k, v, dO (bf16, shape (1, sequences, case.seq, 64)) and the tie count of every query row."""
    g, seq = generator, case.seq
    n_anchor = seq // ROWS_PER_ANCHOR
    ks = torch.empty(sequences, seq, DIM)
    qs = torch.empty(sequences, seq, DIM)
    background = torch.ones(sequences, seq, dtype=torch.bool)
    row_ties = torch.empty(sequences, seq, dtype=torch.long)
    per_count = n_anchor // len(case.tie_counts)
    tie_of_anchor = torch.tensor([t for t in case.tie_counts for _ in range(per_count)])
    for s in range(sequences):
        keys = 0.5 * torch.randn(seq, DIM, generator=g)
        anchors = torch.randn(n_anchor, DIM, generator=g)
        anchors = anchors * (DIM**0.5 / anchors.norm(dim=-1, keepdim=True))  # |anchor|^2 = 64: tied score 8 s
        free = torch.ones(seq, dtype=torch.bool)
        for a in torch.randperm(n_anchor, generator=g).tolist():
            count = int(tie_of_anchor[a])
            if case.spread:
                slots = torch.nonzero(free).flatten()
            else:
                while True:  # a tile with room for all copies
                    tile = int(torch.randint(seq // KEY_TILE, (1,), generator=g))
                    slots = torch.nonzero(free[tile * KEY_TILE:(tile + 1) * KEY_TILE]).flatten() + tile * KEY_TILE
                    if len(slots) >= count:
                        break
            pos = slots[torch.randperm(len(slots), generator=g)[:count]]
            keys[pos] = anchors[a]
            free[pos] = False
        owner = torch.arange(seq) % n_anchor
        lo, hi = case.query_scale
        scale = lo if lo == hi else (lo + (hi - lo) * torch.rand(seq, 1, generator=g))
        qs[s] = scale * anchors[owner] + 0.5 * torch.randn(seq, DIM, generator=g)
        ks[s] = keys
        background[s] = free
        row_ties[s] = tie_of_anchor[owner]
    # control channels: one random sign per (sequence, channel), so sums never cancel and a bias that follows the
    # sign of V (a magnitude bias) averages to zero over them
    sign = torch.where(torch.rand(sequences, 1, DIM, generator=g) < 0.5, -1.0, 1.0)
    sign[..., IMBALANCED] = -1.0
    v = sign * (1.0 + torch.rand(sequences, seq, DIM, generator=g))
    if case.background_v != 1.0:
        v = torch.where(background.unsqueeze(-1), v * case.background_v, v)
    d_out = sign * (1.0 + torch.rand(sequences, seq, DIM, generator=g))
    as_bf16 = lambda t: t.unsqueeze(0).to(torch.bfloat16)  # noqa: E731 - (1, sequences, seq, 64)
    return as_bf16(qs), as_bf16(ks), as_bf16(v), as_bf16(d_out), row_ties


def _outputs(q, k, v, mode, backend: str, o_ref, autotune: bool = True):
    """(O the mode returns, O its backward uses for delta) for a Mode, EXACT or an SDPA backend name; ``autotune``
    (triton backend): tuned or the fixed tiles."""
    import kernels

    if mode == EXACT:
        out = o_ref.to(q.dtype)
        return out, out
    if mode in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[mode])):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out, out
    kw = mode.kwargs()
    if backend == "triton":
        kw["autotune"] = autotune
        out = kernels.flash_attention(q, k, v, causal=False, **kw)
    else:
        out = kernels.reference_attention(q, k, v, causal=False, **kw)
    if mode.fix in ("fp32_output", "exact_delta"):  # delta from an O other than the returned one
        return out, kernels.saved_output(q, k, v, causal=False, backend=backend, **kw)
    return out, out


def measure(q, k, v, d_out, row_ties, mode, backend: str, o_ref=None, autotune: bool = True) -> dict:
    """Mean signed errors of one mode: {'o_imb': {k: ulps}, 'o_ctl': {...}, 'delta': {...}, 'nan_rows': int,
    'zero_rows': int}; tie counts without rows are left out."""
    o_ref = exact_attention(q, k, v, causal=False)[0] if o_ref is None else o_ref
    out, saved = _outputs(q, k, v, mode, backend, o_ref, autotune)
    out, saved, o_ref, dof = (t.double().cpu()[0] for t in (out, saved, o_ref, d_out))
    ulp = bf16_ulp(o_ref)
    err = (out - o_ref) / ulp
    bad = ~torch.isfinite(out).all(-1)
    zeroed = (out == 0).all(-1) & (o_ref != 0).any(-1)
    delta_err = ((saved - o_ref) * dof).sum(-1) / (dof.abs() * ulp).sum(-1)
    result = {"o_imb": {}, "o_ctl": {}, "delta": {}, "nan_rows": int(bad.sum()), "zero_rows": int(zeroed.sum())}
    for ties in TIE_COUNTS:
        rows = (row_ties == ties) & ~bad
        if not rows.any():
            continue
        result["o_imb"][ties] = err[..., IMBALANCED][rows].mean().item()
        result["o_ctl"][ties] = err[..., CONTROL][rows].mean().item()
        result["delta"][ties] = delta_err[rows].mean().item()
    return result


def measure_cases(backend: str = "reference", sequences: int = 32, seed: int | None = None, modes=None, cases=None,
                  paper_block_keys=(None,), progress=None, autotune: bool = True) -> tuple[int, dict]:
    """Measure ``modes`` (Mode, EXACT or SDPA names; default: every mode, bf16(exact), SDPA on CUDA) on ``cases``
    (names; default all). Returns (seed, {case: {label: result}}); ``sequences`` counts 256-row sequences.
    ``autotune`` False: the Triton backend runs on its fixed tiles (``kernels.flash_attention``)."""
    seed = int(torch.randint(0, 2**31 - 1, (1,))) if seed is None else seed
    if modes is None:
        modes = default_modes(paper_block_keys) + [EXACT]
        if torch.cuda.is_available():
            modes += list(SDPA_BACKENDS)
    results = {}
    for name in cases or CASES:
        case = CASES[name]
        gen = torch.Generator().manual_seed(seed)
        q, k, v, d_out, row_ties = build_inputs(max(1, sequences * BASE_SEQ // case.seq), gen, case)
        if backend == "triton" and torch.cuda.is_available() or any(m in SDPA_BACKENDS for m in modes):
            q, k, v, d_out = (t.cuda() for t in (q, k, v, d_out))
        o_ref = exact_attention(q, k, v, causal=False)[0]
        results[name] = {}
        for i, mode in enumerate(modes):
            label = mode if isinstance(mode, str) else mode.label
            t0 = time.time()
            results[name][label] = measure(q, k, v, d_out, row_ties, mode, backend, o_ref, autotune)
            if progress:
                progress(f"[{name} {i + 1}/{len(modes)}] {label}: {time.time() - t0:.1f} s")
    return seed, results


def _cell(values: dict, ties: int, sign: float = 1.0) -> str:
    return f"{sign * values[ties]:+.3f}" if ties in values else "-"


def to_markdown(results: dict, backend: str, sequences: int, seed: int, device: str) -> str:
    """One table per case, with the theory row for paper/none in the tile case."""
    columns = [f"{name} k={t}" for name in ("O imb", "O ctl", "delta") for t in TIE_COUNTS]
    head = "| mode | " + " | ".join(columns) + " | NaN rows | zeroed rows |"
    lines = [f"Tie bias: backend={backend}, device={device}, {sequences * BASE_SEQ} rows per case, seed={seed}.",
             "O columns: mean signed error of O in bf16 ulps (imb = sign-imbalanced channels, ctl = control);",
             "delta columns: mean delta error in units of sum_c |dO_c| ulp(O_c) (dO has the sign of V).", ""]
    for name, by_mode in results.items():
        lines += [f"Case `{name}` ({CASES[name].seq} keys):", "", head, "|" + "---|" * (3 + len(columns))]
        if name == "tile":
            theory = THEORY_PAPER_NONE
            lines.append("| theory paper/none | " + " | ".join(f"{theory[t]:+.3f}" for t in TIE_COUNTS) + " | " +
                         " | ".join("+0.000" for _ in TIE_COUNTS) + " | " +
                         " | ".join(f"{-theory[t]:+.3f}" for t in TIE_COUNTS) + " | 0 | 0 |")
        for label, r in by_mode.items():
            cells = [_cell(r[key], t) for key in ("o_imb", "o_ctl", "delta") for t in TIE_COUNTS]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['nan_rows']} | {r['zero_rows']} |")
        if not any(label in SDPA_BACKENDS for label in by_mode):
            lines.append("| sdpa/flash, sdpa/cudnn | skipped (no CUDA) |" + " |" * (len(columns) + 1))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.tie_bias", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference", help="reference (PyTorch, CPU or GPU) or triton (CUDA; "
                        "on a machine without CUDA the Triton interpreter is used, which is slow)")
    parser.add_argument("--case", nargs="+", default=list(CASES), choices=list(CASES),
                        help="constructions to measure (default: all)")
    parser.add_argument("--paper-block-keys", nargs="+", type=int, default=None, metavar="N",
                        help="paper tile sizes to measure rounding=paper at (keys; 0 = the whole row; default: "
                             f"{PAPER_BLOCK_KEYS} (the authors' code) and 0 (the paper's analysis))")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--sequences", type=int, default=32, help="sequences of 256 query rows per case (cases "
                        "with 1024 keys use a quarter as many: the same rows); default 32 (22 s on the 2-core "
                        "CPU machine, 2026-12-01)")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    parser.add_argument("--fixed-tiles", action="store_true", help="--backend triton: run the kernel on its fixed "
                        "64 x 64 tiles instead of autotuning (compiles once per mode; the tiles the reference uses)")
    args = parser.parse_args(argv)
    if args.backend not in ("reference", "triton"):
        parser.error(f"--backend must be reference or triton, not {args.backend!r}")
    if args.sequences < 1:
        parser.error("--sequences must be >= 1")
    tiles = (PAPER_BLOCK_KEYS, 0)
    if args.paper_block_keys is not None:
        for n in args.paper_block_keys:
            if problem := paper_block_keys_problem(n):
                parser.error(f"--paper-block-keys: {problem}")
        tiles = tuple(args.paper_block_keys)
    if args.out:
        parent = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(parent):
            parser.error(f"--out: folder {parent} does not exist")
    device = "cpu"
    if args.backend == "triton":
        if torch.cuda.is_available():
            device = torch.cuda.get_device_name()
        else:
            os.environ.setdefault("TRITON_INTERPRET", "1")
            device = "cpu (Triton interpreter)"
            print("no CUDA device: running the Triton kernel under TRITON_INTERPRET=1 (slow)", file=sys.stderr)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    seed, results = measure_cases(args.backend, args.sequences, args.seed, cases=args.case, paper_block_keys=tiles,
                                  progress=progress, autotune=not args.fixed_tiles)
    table = to_markdown(results, args.backend, args.sequences, seed, device)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
