"""Bias probe: the signed rounding error of O and of delta = rowsum(dO * O) on rows with k tied maxima.

    python -m kernels.bias_probe [--backend reference|triton] [--out FILE.md] [--sequences N] [--seed S]

Construction (bf16, head_dim 64, 256 keys, non-causal). Each sequence has 16 anchor keys, 4 for each tie count
k = 1..4; anchor g is a random key vector copied to k positions inside one 64-key tile (ties inside one tile are
the case of the paper's mechanism, and one 64-aligned tile lies inside one tile of every kernel configuration), so
its k scores are exactly equal for every query. Query rows are q = 1.5 * anchor + noise (anchors of norm 8, other
keys ~N(0, 0.25)): the tied scores (~12) lead every other score by ~7 or more (concentrated attention: the other keys
hold ~1e-3 of the weight, enough to set the sticky bits of the sums). V has
32 sign-imbalanced channels (every value in [-2, -1): same sign, same exponent, as in the worked example) and 32
control channels (magnitudes alike, one random sign per sequence and channel). dO has the sign of V in every channel.

Reported per mode (rounding x fix) and k: the mean signed error of O against an fp64 reference of the same bf16
inputs, in bf16 ulps of the reference value, for the imbalanced and the control channels; and the mean error of
delta (from the O that the mode's backward uses) in units of sum_c |dO_c| ulp(O_c), where the theory for paper/none
is +1/4, +1/6, +1/8 for k = 2, 3, 4 (the magnitude bias of O times dO, whose sign follows V in every channel).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kernels.modes import FIXES, ROUNDINGS
from kernels.rounding import bf16_ulp

TIE_COUNTS = (1, 2, 3, 4)
THEORY_PAPER_NONE = {1: 0.0, 2: -1 / 4, 3: -1 / 6, 4: -1 / 8}
SEQ, DIM, TILE, ANCHORS_PER_K = 256, 64, 64, 4
IMBALANCED = slice(0, DIM // 2)
CONTROL = slice(DIM // 2, DIM)


def build_inputs(sequences: int, generator: torch.Generator):
    """q, k, v, dO (bf16, shape (1, sequences, 256, 64)) and the tie count of every query row (sequences, 256)."""
    g = generator
    n_anchor = ANCHORS_PER_K * len(TIE_COUNTS)
    ks = torch.empty(sequences, SEQ, DIM)
    qs = torch.empty(sequences, SEQ, DIM)
    row_ties = torch.empty(sequences, SEQ, dtype=torch.long)
    tie_of_anchor = torch.tensor([t for t in TIE_COUNTS for _ in range(ANCHORS_PER_K)])
    for s in range(sequences):
        keys = 0.5 * torch.randn(SEQ, DIM, generator=g)
        anchors = torch.randn(n_anchor, DIM, generator=g)
        anchors = anchors * (DIM**0.5 / anchors.norm(dim=-1, keepdim=True))  # |anchor|^2 = 64: tied score ~12
        free = torch.ones(SEQ, dtype=torch.bool)
        for a in torch.randperm(n_anchor, generator=g).tolist():
            count = int(tie_of_anchor[a])
            while True:  # a tile with room for all copies
                tile = int(torch.randint(SEQ // TILE, (1,), generator=g))
                slots = torch.nonzero(free[tile * TILE:(tile + 1) * TILE]).flatten() + tile * TILE
                if len(slots) >= count:
                    break
            pos = slots[torch.randperm(len(slots), generator=g)[:count]]
            keys[pos] = anchors[a]
            free[pos] = False
        owner = torch.arange(SEQ) % n_anchor
        qs[s] = 1.5 * anchors[owner] + 0.5 * torch.randn(SEQ, DIM, generator=g)
        ks[s] = keys
        row_ties[s] = tie_of_anchor[owner]
    # control channels: one random sign per (sequence, channel), so sums never cancel and a bias that follows the
    # sign of V (a magnitude bias) averages to zero over them
    sign = torch.where(torch.rand(sequences, 1, DIM, generator=g) < 0.5, -1.0, 1.0)
    sign[..., IMBALANCED] = -1.0
    v = sign * (1.0 + torch.rand(sequences, SEQ, DIM, generator=g))
    d_out = sign * (1.0 + torch.rand(sequences, SEQ, DIM, generator=g))
    as_bf16 = lambda t: t.unsqueeze(0).to(torch.bfloat16)  # noqa: E731 - (1, sequences, 256, 64)
    return as_bf16(qs), as_bf16(ks), as_bf16(v), as_bf16(d_out), row_ties


def fp64_attention(q, k, v):
    """Exact (fp64) softmax attention of the same bf16 inputs, non-causal."""
    q, k, v = (t.double() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s, dim=-1) @ v


def measure(q, k, v, d_out, row_ties, rounding: str, fix: str, backend: str) -> dict:
    """Mean signed errors of one mode: {'o_imb': {k: ulps}, 'o_ctl': {...}, 'delta': {...}, 'nan_rows': int}."""
    import kernels

    o_ref = fp64_attention(q, k, v)
    if backend == "triton":
        out = kernels.flash_attention(q, k, v, causal=False, rounding=rounding, fix=fix)
    else:
        out = kernels.reference_attention(q, k, v, causal=False, rounding=rounding, fix=fix)
    saved = kernels.saved_output(q, k, v, causal=False, rounding=rounding, fix=fix, backend=backend)
    out, saved, o_ref, dof = (t.double().cpu()[0] for t in (out, saved, o_ref, d_out))
    ulp = bf16_ulp(o_ref)
    err = (out - o_ref) / ulp
    bad = ~torch.isfinite(out).all(-1)
    delta_err = ((saved - o_ref) * dof).sum(-1) / (dof.abs() * ulp).sum(-1)
    result = {"o_imb": {}, "o_ctl": {}, "delta": {}, "nan_rows": int(bad.sum())}
    for ties in TIE_COUNTS:
        rows = (row_ties == ties) & ~bad
        result["o_imb"][ties] = err[..., IMBALANCED][rows].mean().item()
        result["o_ctl"][ties] = err[..., CONTROL][rows].mean().item()
        result["delta"][ties] = delta_err[rows].mean().item()
    return result


def run_probe(backend: str = "reference", sequences: int = 32, seed: int | None = None, modes=None,
              progress=None) -> tuple[int, dict]:
    """Measure every mode (or ``modes``: list of (rounding, fix)); returns (seed, {(rounding, fix): result})."""
    seed = int(torch.randint(0, 2**31 - 1, (1,))) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    q, k, v, d_out, row_ties = build_inputs(sequences, gen)
    if backend == "triton" and torch.cuda.is_available():
        q, k, v, d_out = (t.cuda() for t in (q, k, v, d_out))
    modes = modes or [(r, f) for r in ROUNDINGS for f in FIXES]
    results = {}
    for i, (rounding, fix) in enumerate(modes):
        t0 = time.time()
        results[(rounding, fix)] = measure(q, k, v, d_out, row_ties, rounding, fix, backend)
        if progress:
            progress(f"[{i + 1}/{len(modes)}] {rounding}/{fix}: {time.time() - t0:.1f} s")
    return seed, results


def to_markdown(results: dict, backend: str, sequences: int, seed: int, device: str) -> str:
    """Tables of the probe's results, with the theory row for paper/none."""
    head = "| mode | " + " | ".join(f"O imb k={t}" for t in TIE_COUNTS) + " | " + \
        " | ".join(f"O ctl k={t}" for t in TIE_COUNTS) + " | " + " | ".join(f"delta k={t}" for t in TIE_COUNTS) + \
        " | NaN rows |"
    lines = [f"Bias probe: backend={backend}, device={device}, {sequences} sequences x 256 rows, seed={seed}.",
             "O columns: mean signed error of O in bf16 ulps (imb = sign-imbalanced channels, ctl = control);",
             "delta columns: mean delta error in units of sum_c |dO_c| ulp(O_c) (dO has the sign of V).", "",
             head, "|" + "---|" * (2 + 3 * len(TIE_COUNTS))]
    theory = THEORY_PAPER_NONE
    lines.append("| theory paper/none | " + " | ".join(f"{theory[t]:+.3f}" for t in TIE_COUNTS) + " | " +
                 " | ".join("+0.000" for _ in TIE_COUNTS) + " | " +
                 " | ".join(f"{-theory[t]:+.3f}" for t in TIE_COUNTS) + " | 0 |")
    for (rounding, fix), r in results.items():
        cells = [f"{r[key][t]:+.3f}" for key in ("o_imb", "o_ctl", "delta") for t in TIE_COUNTS]
        lines.append(f"| {rounding}/{fix} | " + " | ".join(cells) + f" | {r['nan_rows']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bias_probe", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference", help="reference (PyTorch, CPU or GPU) or triton (CUDA; "
                        "on a machine without CUDA the Triton interpreter is used, which is slow)")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--sequences", type=int, default=32, help="sequences of 256 query rows (default 32)")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh, printed)")
    args = parser.parse_args(argv)
    if args.backend not in ("reference", "triton"):
        parser.error(f"--backend must be reference or triton, not {args.backend!r}")
    if args.sequences < 1:
        parser.error("--sequences must be >= 1")
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
    seed, results = run_probe(args.backend, args.sequences, args.seed, progress=progress)
    table = to_markdown(results, args.backend, args.sequences, seed, device)
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
