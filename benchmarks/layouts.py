"""Throughput and losses of one recipe under several process layouts, measured in one go on one machine.

    python -m benchmarks.layouts RECIPE [--layouts single,dp2,dp2_zero1,dp2_zero2,tp2] [--steps 12] [--skip 3]
                                 [--json FILE] [section.field=value ...]

Each layout trains the recipe's first arm for ``--steps`` optimizer steps from the same seed on the same batches
(torchrun with one process per GPU; no evaluation, monitors or checkpoints). Reported: tokens/s (median over the
steps after the first ``--skip``), speedup over the single-process layout and scaling efficiency (speedup / GPUs),
the ideal idle fraction of a 1F1B pipeline for the layout's micro-batch count (the measured loss against 2x is
the bubble plus communication and imbalance), the largest relative difference of the training loss from the
single-process run, and rank 0's peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from launcher.compare import load_scalars
from launcher.config import arm_names, load_config, load_recipe
from launcher.monitors import tags

ZERO_OVERLAP = ["parallel.zero_overlap_comm=true", "parallel.zero_reduce_bucket_size=50000000",
                "parallel.zero_allgather_bucket_size=50000000"]
LAYOUTS = {  # name: (processes, overrides)
    "single": (1, []),
    "dp2": (2, []),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "dp2_zero2": (2, ["parallel.zero_stage=2"]),
    "dp2_zero3": (2, ["parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tensor_parallel=2"]),
    "pp2": (2, ["parallel.pipeline_parallel=2"]),
    "tp2_pp2": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]),
    # sequence parallelism and the overlap settings (docs/parallelism.md, "Overlap"); the ZeRO buckets are 1/10 of
    # DeepSpeed's default 5e8 elements, so that reductions start earlier in the backward (a first guess to measure)
    "tp2_sp": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    "tp2_async": (2, ["parallel.tensor_parallel=2", "parallel.tp_async_grad_reduce=true"]),
    "tp2_sp_async": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true",
                         "parallel.tp_async_grad_reduce=true"]),
    "dp2_bucket100": (2, ["parallel.ddp_bucket_mb=100"]),
    "dp2_zero1_overlap": (2, ["parallel.zero_stage=1", *ZERO_OVERLAP]),
    "dp2_zero2_overlap": (2, ["parallel.zero_stage=2", *ZERO_OVERLAP]),
    "tp2_pp2_sp": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2",
                       "parallel.sequence_parallel=true"]),
}
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(recipe: str, arm: str, name: str, steps: int, out_dir: Path, overrides: list[str]) -> dict:
    nproc, layout = LAYOUTS[name]
    args = ["-m", "launcher.pretrain", recipe, "--arm", arm, "--no-report", f"run.out_dir={out_dir}", f"run.experiment={name}",
            f"run.max_steps={steps}", "run.log_interval=1", "eval.interval=0", "monitor.spectral_interval=0",
            "monitor.probe_interval=0", "checkpoint.enabled=false", *overrides, *layout]
    cmd = [sys.executable, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
         str(free_port()), *args]
    print(f"[layouts] {name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[layouts] {name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    scalars = load_scalars(out_dir / name / arm)
    as_dict = {tag: dict(zip(steps.tolist(), values.tolist())) for tag, (steps, values) in scalars.items()}
    return {"gpus": nproc, "log": proc.stdout, "bubble": ideal_bubble(recipe, arm, nproc, overrides + layout),
            **{k: as_dict.get(k, {}) for k in
                                                 (tags.TRAIN_LOSS, tags.TOKENS_PER_S, tags.MAX_MEMORY_GB)}}


def ideal_bubble(recipe: str, arm: str, nproc: int, overrides: list[str]) -> float:
    """Idle fraction of a 1F1B pipeline with equal stages and free communication: (p - 1) / (m + p - 1) for p
    stages and m micro-batches per step (Narayanan et al., 2021); 0 without a pipeline."""
    config = load_config(recipe, overrides, arm=arm)
    p = config.parallel.pipeline_parallel
    dp = nproc // (p * config.parallel.tensor_parallel)
    m = config.data.global_batch_size // (config.data.micro_batch_size * dp)
    return (p - 1) / (m + p - 1)


def summarise(results: dict, skip: int) -> list[dict]:
    base = results.get("single")
    rows = []
    for name, r in results.items():
        timed = [v for s, v in sorted(r[tags.TOKENS_PER_S].items()) if s > skip]
        tok_s = statistics.median(timed) if timed else float("nan")
        row = {"layout": name, "gpus": r["gpus"], "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / r["gpus"],
               "max_memory_gb": max(r[tags.MAX_MEMORY_GB].values(), default=float("nan")),
               "ideal_pipeline_bubble": r["bubble"]}
        if base is not None:
            base_tok = statistics.median(v for s, v in sorted(base[tags.TOKENS_PER_S].items()) if s > skip)
            row["speedup"] = tok_s / base_tok
            row["scaling_efficiency"] = row["speedup"] / r["gpus"]
            row["max_loss_rel_diff"] = max(abs(r[tags.TRAIN_LOSS][s] - v) / abs(v)
                                           for s, v in base[tags.TRAIN_LOSS].items())
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| layout | processes | tokens/s | per process | speedup vs 1 | scaling efficiency | ideal 1F1B bubble "
             "| max loss diff vs 1 | peak memory rank 0 (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{r.get('speedup', float('nan')):.3f} | {100 * r.get('scaling_efficiency', float('nan')):.1f}% | "
                     f"{100 * r['ideal_pipeline_bubble']:.1f}% | "
                     f"{r.get('max_loss_rel_diff', float('nan')):.1e} | {r['max_memory_gb']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--arm", help="the arm to train (default: the recipe's first)")
    parser.add_argument("--layouts", default="single,dp2,dp2_zero1,dp2_zero2,tp2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the throughput median")
    parser.add_argument("--json", help="also write the rows (and each run's log) to this file")
    args = parser.parse_intermixed_args(argv)
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    arm = args.arm or arm_names(load_recipe(args.recipe))[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: run_layout(args.recipe, arm, n, args.steps, Path(tmp), args.overrides) for n in names}
    rows = summarise(results, args.skip)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": args.recipe, "overrides": args.overrides, "rows": rows,
                                               "logs": {n: r["log"] for n, r in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
