"""Stability margin of attention numerics: ``python -m analysis.margin RECIPE [section.field=value ...]``.

Trains a grid of arms (numerics x delta-error gain x sign x seed) through the normal launcher, several at
once on one device, judges each arm stable or diverged, and writes the margin report (analysis/margin_report.py).
The recipe is a normal training recipe (recipes/margin.yaml) plus a ``margin`` section (:class:`MarginConfig`); it
has no ``arms``: the grid makes them. What the table means and the rules: docs/margin.md.

- Each seed is its own experiment, ``<run.out_dir>/<run.experiment>/seed_<N>/``, so the arms of one seed train on
  identical batches (the same ``run.seed``). Its generated recipe ``recipe.yaml`` (every arm of the grid) sits there;
  each arm runs as ``python -m launcher.pretrain <that recipe> --arm NAME --no-report`` in a subprocess, its output
  in ``seed_<N>/logs/<arm>.log``.
- Redundant cells are collapsed into one arm (fix=fp32_output has no delta error, so every gain and sign is the same
  run; gain 1 with the kept sign is the mode itself and runs without delta fields; gain 0 is the same for both signs).
- ``margin.schedule=bisect`` (default) runs, per (numerics, sign, seed), the gains a bisection needs to find where
  divergence starts (assuming that a larger gain never makes training more stable; the report says which cells
  were implied rather than run), most informative first; idle process slots run the arms either outcome needs
  next. ``full`` runs every cell, in the same order. Diverged arms are stopped early (``margin.stop_diverged``).
- Ctrl-C (or SIGTERM) asks every running arm to save a checkpoint and exit; rerunning the same command resumes
  them and skips arms already judged (``margin_state.json`` in the experiment folder).
- The grid must fit the machine (:func:`fit_problems`): on a GPU, ``margin.processes`` x ``margin.arm_memory_gb`` in
  its memory; on a CPU, one core per arm and ``margin.processes`` x one arm's host memory (estimated from the model,
  :func:`cpu_arm_memory_gb`, or ``margin.arm_host_memory_gb``) in the memory available; else the command refuses it
  and names the value to set. ``--machine cpus=2,memory_gb=8`` (or ``gpu_gb=80``) plans for another machine.
- An arm killed by a signal (``kill -9``, the out-of-memory killer) is named so, with the signal; after a SIGKILL
  fewer arms run at once, and the same command starts the arm again up to ``margin.retries`` times (it resumes from
  its last checkpoint). Arms still killed, or failed, are started again by ``--retry-failed``.
- ``--dry-run`` prints the plan and the time estimate (also before the data is prepared); ``--report-only``
  rewrites the report from the runs so far (e.g. with other warning thresholds: ``monitor.warning_tie_rate=0.2``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from kernels.modes import DELTA_REFERENCES, FIXES, REFERENCE_FIX, ROUNDINGS
from launcher.config import (ConfigError, _build, build_config, environment_problems, field_docs, load_recipe,
                             problems_error)
from analysis.margin_report import STATE_FILE, bisect_path, load_state, save_state
from model.attention import AttentionConfig

REPO = Path(__file__).resolve().parent.parent
SIGNS = ("kept", "random")
SCHEDULES = ("bisect", "full")
DELTA_FIELDS = ("delta_gain", "delta_sign", "delta_reference", "output_gain", "output_sign")
STRESSES = ("delta", "output")


@dataclass
class MarginConfig:
    """The grid of a margin run and how it is scheduled and judged (section ``margin`` of the recipe)."""

    numerics: list[str] = field(default_factory=lambda: ["paper/none", "fa2/none"])
    """Attention numerics to compare, each "rounding/fix" (attention.rounding / attention.fix), e.g. paper/none."""
    gains: list[float] = field(default_factory=lambda: [1.0, 5.0, 10.0, 20.0, 50.0, 100.0])
    """Delta-error gains g (attention.delta_gain): delta = delta_ref + g * s * (delta_mode - delta_ref). 1 = the
    mode's own numerics, 0 = the reference's delta (margin.reference)."""
    stress: str = "delta"
    """What the gains amplify: delta (the backward's delta error, attention.delta_gain / delta_sign) or output (the
    rounding error of the O the next layer sees, attention.output_gain / output_sign: O = LP(O_fp32 + g * s *
    (O_mode - O_fp32)); the backward keeps the mode's delta, and margin.reference does not apply)."""
    reference: str = "fp32_output"
    """delta_ref of the gains' formula (attention.delta_reference): fp32_output (delta from the FP32 O of the same
    forward; fix=fp32_output then has no error to amplify) or exact (rowsum(P * dP) with the backward's own P, as
    fix=exact_delta computes it; then fp32_output gets a finite margin and exact_delta has none to measure)."""
    signs: list[str] = field(default_factory=lambda: ["kept", "random"])
    """Signs s of the amplified error (attention.delta_sign): kept (the mode's own, persistent sign) and/or random
    (+-1 per row and step: the control with the same error size but no persistent sign)."""
    seeds: list[int] = field(default_factory=lambda: [1337])
    """run.seed of each seed experiment; the arms of one seed train on identical batches."""
    schedule: str = "bisect"
    """bisect: per (numerics, sign, seed) only the gains a bisection needs (assumes a larger gain never makes
    training more stable); full: every cell. Both run the most informative arms first."""
    processes: int = 16
    """Arms trained at once (one process each, all on the same device)."""
    budget_minutes: float = 15.0
    """Refuse a grid whose estimated wall time is above this (0: no limit)."""
    step_seconds: float = 0.12
    """Estimated seconds per optimizer step of one arm while `processes` arms share the device (for the estimate
    only; the report prints the measured value to put here)."""
    startup_seconds: float = 30.0
    """Estimated seconds from starting an arm's process to its first step (imports, data, compilation)."""
    arm_memory_gb: float = 6.0
    """Estimated peak GPU memory of one arm (the report prints the measured perf/max_memory_gb); processes x this
    must fit in the GPU's memory."""
    arm_host_memory_gb: float = 0.0
    """On a CPU: peak host memory of one arm; 0 estimates it from the model and batch shape (cpu_arm_memory_gb in
    analysis/margin.py). processes x this must fit in the host's available memory, and processes in its cores."""
    retries: int = 2
    """Times this command starts an arm again after a signal killed it (e.g. the out-of-memory killer); it resumes
    from its last checkpoint. Arms still killed, or failed, after that are started again by --retry-failed."""
    stop_diverged: bool = True
    """Stop an arm as soon as it is judged diverged (frees its process slot; its curves end there)."""
    loss_margin: float = 1.0
    """Divergence: train loss above the median of the seed's arms at the same step by more than this (nats)..."""
    grad_factor: float = 10.0
    """...or gradient norm above this factor x the median of the seed's arms at the same step (0 disables)..."""
    patience: int = 3
    """...on this many consecutive logged points. (A non-finite loss or gradient norm diverges at once.)"""
    min_arms: int = 3
    """Arms that must have logged a step for its median to be the reference; with fewer, the arm's own lowest loss
    so far is the loss reference (and the gradient rule waits)."""
    progress_seconds: float = 30.0
    """Print a progress line (arms done / diverged / running, ETA) every this many seconds."""
    max_minutes: float = 0.0
    """Wall-clock limit of this invocation (0: none): when it is spent, every running arm saves a checkpoint and
    stops, and the command exits with status 130; the same command continues. For fixed-length allocations."""


# ----------------------------------------------------------------------------------------------------------------
# The grid


@dataclass(frozen=True)
class Cell:
    """One point of the grid (before collapsing)."""

    numerics: str
    gain: float
    sign: str
    seed: int


@dataclass
class ArmSpec:
    """One run: the attention section it trains with and the grid cells it stands for."""

    name: str
    seed: int
    attention: dict
    cells: list[Cell]

    @property
    def key(self) -> str:
        return f"seed_{self.seed}/{self.name}"


@dataclass
class Plan:
    """The grid expanded and collapsed; ``series`` maps (numerics, sign, seed) to its arms by ascending gain."""

    config: MarginConfig
    arms: dict[str, ArmSpec]  # by key
    series: dict[tuple[str, str, int], list[tuple[float, str]]]
    notes: list[str]

    def arm_of(self, cell: Cell) -> ArmSpec:
        return next(a for a in self.arms.values() if cell in a.cells)


def split_numerics(text: str) -> tuple[str, str]:
    rounding, _, fix = text.partition("/")
    return rounding, fix


def arm_name(rounding: str, fix: str, gain: Optional[float], sign: Optional[str]) -> str:
    base = f"{rounding}-{fix}"
    if gain is None:
        return base
    return f"{base}_g{gain:g}" + (f"_{sign}" if sign else "")


def cell_arm(cell: Cell, reference: str = "fp32_output", stress: str = "delta") -> tuple[str, dict, str]:
    """(arm name, attention section, why collapsed or '') of a cell: the delta error measured from ``reference``
    amplified, or (``stress`` output) the output's rounding error."""
    rounding, fix = split_numerics(cell.numerics)
    attention = {"rounding": rounding, "fix": fix}
    if stress == "delta" and fix == REFERENCE_FIX[reference]:
        return arm_name(rounding, fix, None, None), attention, f"fix={fix} has no delta error against {reference}"
    if cell.gain == 1.0 and cell.sign == "kept":
        return arm_name(rounding, fix, 1.0, "kept"), attention, ""
    gain_field, sign_field = f"{stress}_gain", f"{stress}_sign"
    extra = {"delta_reference": reference} if stress == "delta" and reference != "fp32_output" else {}
    if cell.gain == 0.0:
        return (arm_name(rounding, fix, 0.0, None), {**attention, gain_field: 0.0, **extra},
                "gain 0 removes the sign")
    return arm_name(rounding, fix, cell.gain, cell.sign), {**attention, gain_field: cell.gain,
                                                           sign_field: cell.sign, **extra}, ""


def expand(config: MarginConfig) -> Plan:
    """Every cell of the grid, collapsed into the distinct runs (see the module docstring)."""
    arms: dict[str, ArmSpec] = {}
    collapsed: dict[str, int] = {}
    series: dict[tuple[str, str, int], list[tuple[float, str]]] = {}
    for seed in config.seeds:
        for numerics in config.numerics:
            for sign in config.signs:
                for gain in sorted(config.gains):
                    cell = Cell(numerics, float(gain), sign, seed)
                    name, attention, why = cell_arm(cell, config.reference, config.stress)
                    key = f"seed_{seed}/{name}"
                    if key in arms:
                        arms[key].cells.append(cell)
                        collapsed[why or name] = collapsed.get(why or name, 0) + 1
                    else:
                        arms[key] = ArmSpec(name, seed, attention, [cell])
                    series.setdefault((numerics, sign, seed), []).append((float(gain), key))
    cells = sum(len(a.cells) for a in arms.values())
    notes = [f"{cells} cells -> {len(arms)} distinct runs"]
    for why, n in collapsed.items():
        notes.append(f"  {n} cell(s) collapsed: {why}, so their gains/signs are one run")
    if any(g == 1.0 for g in config.gains) and "kept" in config.signs:
        notes.append("  gain 1 with the kept sign is the mode itself: those arms train without delta fields")
    return Plan(config, arms, series, notes)


def margin_problems(m: MarginConfig) -> list[str]:
    """Problems of the margin section, each saying what to change."""
    problems = []
    for i, text in enumerate(m.numerics):
        rounding, fix = split_numerics(text)
        if rounding not in ROUNDINGS or fix not in FIXES:
            problems.append(f"margin.numerics[{i}]={text!r} must be rounding/fix with rounding in "
                            f"{'|'.join(ROUNDINGS)} and fix in {'|'.join(FIXES)}, e.g. paper/none")
    if not m.numerics:
        problems.append("margin.numerics is empty; list at least one rounding/fix, e.g. [paper/none]")
    if len(set(m.numerics)) != len(m.numerics):
        problems.append("margin.numerics lists a numerics twice; list each once")
    if not m.gains or any(not (math.isfinite(g) and g >= 0) for g in m.gains) or len(set(m.gains)) != len(m.gains):
        problems.append(f"margin.gains={m.gains} must be distinct finite numbers >= 0, e.g. [1, 5, 10, 20]")
    if not m.signs or any(s not in SIGNS for s in m.signs) or len(set(m.signs)) != len(m.signs):
        problems.append(f"margin.signs={m.signs} must be distinct values of: {', '.join(SIGNS)}")
    if not m.seeds or len(set(m.seeds)) != len(m.seeds):
        problems.append(f"margin.seeds={m.seeds} must be distinct integers, e.g. [1337, 1338]")
    if m.stress not in STRESSES:
        problems.append(f"margin.stress={m.stress!r} is not one of: {', '.join(STRESSES)}")
    if m.reference not in DELTA_REFERENCES:
        problems.append(f"margin.reference={m.reference!r} is not one of: {', '.join(DELTA_REFERENCES)}")
    if m.schedule not in SCHEDULES:
        problems.append(f"margin.schedule={m.schedule!r} is not one of: {', '.join(SCHEDULES)}")
    if m.processes < 1:
        problems.append(f"margin.processes={m.processes} must be >= 1")
    for name in ("budget_minutes", "step_seconds", "startup_seconds", "arm_memory_gb", "grad_factor",
                 "progress_seconds", "max_minutes"):
        if not getattr(m, name) >= 0:
            problems.append(f"margin.{name}={getattr(m, name)} must be >= 0")
    if not m.loss_margin > 0:
        problems.append(f"margin.loss_margin={m.loss_margin} must be > 0 (nats above the median, e.g. 1.0)")
    if m.patience < 1 or m.min_arms < 1:
        problems.append("margin.patience and margin.min_arms must be >= 1")
    if m.retries < 0 or not m.arm_host_memory_gb >= 0:
        problems.append("margin.retries and margin.arm_host_memory_gb must be >= 0")
    return problems


def delta_fields_problem(plan: Plan) -> Optional[str]:
    """The arms need attention.delta_gain / delta_sign; say so if this checkout's config lacks them."""
    have = {f.name for f in dataclasses.fields(AttentionConfig)}
    needing = [a.name for a in plan.arms.values() if set(a.attention) & set(DELTA_FIELDS)]
    used = {f for a in plan.arms.values() for f in a.attention if f in DELTA_FIELDS}
    if needing and not used <= have:
        return (f"margin.gains/signs need attention.delta_gain and attention.delta_sign, which this "
                f"checkout's AttentionConfig does not have (arms {', '.join(needing[:3])}...); use margin.gains=[1] "
                "margin.signs=[kept], or a checkout with the delta-gain fields")
    return None


def parse_margin(tree: dict) -> MarginConfig:
    raw = tree.get("margin") or {}
    if not isinstance(raw, dict):
        raise ConfigError("margin must be a mapping of MarginConfig fields (see python -m analysis.margin "
                          "--help-config)")
    problems: list[str] = []
    config = _build(MarginConfig, raw, "margin", problems)
    problems += margin_problems(config) if not problems else []  # its checks would read the defaults of bad fields
    if problems:
        raise problems_error(problems)
    return config


def seed_tree(tree: dict, plan: Plan, seed: int, experiment_dir: Path) -> dict:
    """The generated recipe of one seed: the base recipe with this seed and the grid's arms of this seed."""
    out = copy.deepcopy({k: v for k, v in tree.items() if k not in ("margin", "arms")})
    run = out.setdefault("run", {})
    run.update(seed=seed, out_dir=str(experiment_dir), experiment=f"seed_{seed}")
    run.pop("arm", None)
    out["arms"] = {a.name: {"attention": dict(a.attention)} for a in plan.arms.values() if a.seed == seed}
    return out


# ----------------------------------------------------------------------------------------------------------------
# Scheduling


def tree_depths(n: int) -> list[int]:
    """Depth of each index in the bisection tree over n sorted gains (the middle first)."""
    depths = [0] * n

    def visit(lo: int, hi: int, d: int) -> None:
        if lo > hi:
            return
        mid = (lo + hi) // 2
        depths[mid] = d
        visit(lo, mid - 1, d + 1)
        visit(mid + 1, hi, d + 1)

    visit(0, n - 1, 0)
    return depths


def _series_rank(plan: Plan, sid: tuple[str, str, int]) -> tuple[int, int, int]:
    c = plan.config
    return c.numerics.index(sid[0]), c.signs.index(sid[1]), c.seeds.index(sid[2])


def next_arms(plan: Plan, status_of, running: set[str]) -> list[str]:
    """Arms to start next, best first: needed ones (bisect: the unknown gain of each series' bisection; full: every
    cell, middle gains first), then speculative ones (the gains a running bisection needs after either outcome).
    ``status_of(key)`` -> 'survived' | 'diverged' | other/None (not judged)."""
    needed: list[tuple[tuple, str]] = []
    spare: list[tuple[tuple, str]] = []
    for sid, gains in plan.series.items():
        rank = _series_rank(plan, sid)
        if plan.config.schedule == "full":
            for (g, key), d in zip(gains, tree_depths(len(gains))):
                needed.append(((d, *rank), key))
            continue
        index, depth, (lo, hi) = bisect_path(gains, status_of)
        if index is None:
            continue
        needed.append(((depth, *rank), gains[index][1]))
        if gains[index][1] in running:  # both children of the pending node
            for a, b in ((lo, index - 1), (index + 1, hi)):
                if a <= b:
                    spare.append(((depth + 1, *rank), gains[(a + b) // 2][1]))
    out, seen = [], set()
    for _, key in sorted(needed) + sorted(spare):
        if key not in seen and key not in running and status_of(key) not in ("survived", "diverged", "failed",
                                                                             "killed"):
            seen.add(key)
            out.append(key)
    return out


def worst_case_runs(plan: Plan) -> list[int]:
    """Per series, the most runs it needs one after the other (bisect: ceil(log2(n + 1)) over its distinct arms)."""
    chains = []
    done: set[str] = set()
    for gains in plan.series.values():
        keys = [k for _, k in gains if k not in done]
        done.update(keys)
        if not keys:
            continue
        distinct = len(dict.fromkeys(keys))
        chains.append(distinct if plan.config.schedule == "full" else math.ceil(math.log2(distinct + 1)))
    return chains


def waves(chains: list[int], processes: int, full: bool) -> int:
    """Rounds of ``processes`` equal-length arms that the chains need (longest chains first)."""
    if full:
        return math.ceil(sum(chains) / processes)
    left = sorted(chains, reverse=True)
    rounds = 0
    while any(left):
        order = sorted(range(len(left)), key=lambda i: -left[i])
        for i in order[:processes]:
            if left[i]:
                left[i] -= 1
        rounds += 1
    return rounds


@dataclass
class Estimate:
    runs: int
    rounds: int
    arm_minutes: float
    minutes: float

    def describe(self, m: MarginConfig, steps: int) -> str:
        return (f"at most {self.runs} runs in {self.rounds} round(s) of {m.processes} at once, each ~"
                f"{self.arm_minutes:.1f} min ({m.startup_seconds:g} s start + {steps} steps x {m.step_seconds:g} s, "
                f"margin.step_seconds/startup_seconds are estimates): ~{self.minutes:.1f} min, less when diverged "
                "arms stop early")


def estimate(plan: Plan, steps: int) -> Estimate:
    m = plan.config
    chains = worst_case_runs(plan)
    rounds = waves(chains, m.processes, m.schedule == "full")
    arm_minutes = (m.startup_seconds + steps * m.step_seconds) / 60
    return Estimate(sum(chains), rounds, arm_minutes, rounds * arm_minutes)


@dataclass
class Machine:
    """What the arms share: one GPU's memory (``gpu_gb`` > 0), or this host's CPU cores and available memory."""

    gpu_gb: float = 0.0
    cpus: int = 1
    memory_gb: float = 0.0

    @classmethod
    def detect(cls, on_gpu: bool) -> "Machine":
        """This machine: the first GPU when the arms run there, else the cores this process may use and the host
        memory available now (/proc/meminfo's MemAvailable: what other jobs leave)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if on_gpu:
            import torch

            return cls(gpu_gb=torch.cuda.get_device_properties(0).total_memory / 2**30, cpus=cpus)
        available = None
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            available = int(info["MemAvailable"].split()[0]) / 2**20
        except (OSError, KeyError, ValueError):
            pass
        if available is None:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return cls(cpus=cpus, memory_gb=available)

    @classmethod
    def parse(cls, text: str) -> "Machine":
        """``gpu_gb=80`` or ``cpus=2,memory_gb=8`` (--machine: plan for another machine, or simulate a small one)."""
        values = {}
        for part in filter(None, text.split(",")):
            key, _, value = part.partition("=")
            if key.strip() not in ("gpu_gb", "cpus", "memory_gb"):
                raise ConfigError(f"--machine {text}: {key.strip()!r} is not one of gpu_gb, cpus, memory_gb "
                                  "(e.g. --machine cpus=2,memory_gb=8 or --machine gpu_gb=80)")
            try:
                values[key.strip()] = int(value) if key.strip() == "cpus" else float(value)
            except ValueError:
                raise ConfigError(f"--machine {text}: {key.strip()}={value!r} is not a number") from None
        if not all(math.isfinite(v) and v > 0 for v in values.values()):
            raise ConfigError(f"--machine {text}: sizes must be positive numbers")
        return cls(**values)

    def describe(self) -> str:
        if self.gpu_gb:
            return f"one GPU of {self.gpu_gb:.0f} GB"
        return f"CPU: {self.cpus} core(s), {self.memory_gb:.1f} GB of host memory available"


# Peak host memory of one arm on a CPU (fp32, the PyTorch reference attention, monitors on), fitted to the maximum
# resident set size (/usr/bin/time -v) of 2-step arms of `launcher.pretrain smoke` on the 2-core CPU machine, vocabulary
# 8,192 (2026-12-02): 6 x 384, 6 heads, context 256, micro-batch 64: 5.50 GB (estimate 5.9); micro-batch 16: 1.95
# (1.96); context 128, micro-batch 32: 1.89 (1.89); 2 layers, micro-batch 16: 1.35 (1.34); smoke's 4 x 128: 0.54 (0.57).
CPU_ARM_BASE_GB = 0.45  # Python, torch, TensorBoard
CPU_BYTES_PER_TOKEN_LAYER_D = 72  # activations per token and layer, per unit of d_model (~18 FP32 copies)
CPU_BYTES_PER_TOKEN_LAYER_SCORE = 4  # ... per attention score of the token's row (n_head x seq_len)
CPU_BYTES_PER_TOKEN_VOCAB = 17  # logits, their softmax and gradient, per token and vocabulary entry


def cpu_arm_memory_gb(config) -> float:
    """Estimated peak host memory of one arm of ``config`` on a CPU, in GB: the process, parameters with gradients
    and Adam state (16 bytes each), and the activations of one micro-batch (see the constants above)."""
    from launcher.config import parameter_estimate

    m, d = config.model, config.data
    params, vocab = parameter_estimate(config)
    tokens = d.micro_batch_size * d.seq_len
    per_token = (m.n_layer * (CPU_BYTES_PER_TOKEN_LAYER_D * m.d_model
                              + CPU_BYTES_PER_TOKEN_LAYER_SCORE * m.n_head * d.seq_len)
                 + CPU_BYTES_PER_TOKEN_VOCAB * vocab)
    return CPU_ARM_BASE_GB + (16 * params + tokens * per_token) / 2**30


def fit_problems(plan: Plan, steps: int, machine: Machine, host_arm_gb: float = 0.0) -> list[str]:
    """Why the grid cannot run as configured on ``machine`` (time budget; GPU memory, or CPU cores and host memory,
    ``host_arm_gb`` being one arm's host memory on a CPU), each saying what to change."""
    m = plan.config
    problems = []
    est = estimate(plan, steps)
    if m.budget_minutes and est.minutes > m.budget_minutes:
        problems.append(f"the grid needs ~{est.minutes:.1f} min ({est.describe(m, steps)}), above "
                        f"margin.budget_minutes={m.budget_minutes:g}: drop gains, numerics, signs or seeds, lower "
                        "run.max_steps, raise margin.processes, " + ("use margin.schedule=bisect, " if m.schedule == "full" else "")
                        + "or raise margin.budget_minutes")
    if machine.gpu_gb and m.processes * m.arm_memory_gb > 0.92 * machine.gpu_gb:
        fit = max(1, int(0.92 * machine.gpu_gb // max(m.arm_memory_gb, 1e-9)))
        problems.append(f"margin.processes={m.processes} x margin.arm_memory_gb={m.arm_memory_gb:g} GB does not fit in "
                        f"the GPU's {machine.gpu_gb:.0f} GB: set margin.processes={fit} (or measure the arm's memory "
                        "and set margin.arm_memory_gb)")
    elif not machine.gpu_gb:
        source = ("margin.arm_host_memory_gb" if m.arm_host_memory_gb else
                  "estimated from the model and batch shape; set margin.arm_host_memory_gb if you measured it")
        by_memory = int(0.9 * machine.memory_gb // max(host_arm_gb, 1e-9))
        fit = min(machine.cpus, by_memory)
        if fit < 1:
            problems.append(f"one arm needs ~{host_arm_gb:.1f} GB of host memory ({source}) and this machine has "
                            f"{machine.memory_gb:.1f} GB available: shrink the arm (data.micro_batch_size, "
                            "data.seq_len, model.*) or use a GPU")
        elif m.processes > fit:
            limit = (f"{machine.cpus} core(s)" if fit == machine.cpus else
                     f"{machine.memory_gb:.1f} GB of host memory available, ~{host_arm_gb:.1f} GB per arm ({source})")
            problems.append(f"margin.processes={m.processes} arms at once do not fit this CPU machine ({limit}): "
                            f"set margin.processes={fit}")
    return problems


# ----------------------------------------------------------------------------------------------------------------
# Running

PROGRESS = re.compile(r"step\s+(\d+)/\d+ \| loss (\S+) \| lr \S+ \| grad norm (\S+)")


def parse_progress(line: str) -> Optional[tuple[int, float, float]]:
    """(step, loss, grad norm) of a trainer progress line (launcher/metrics.py), else None."""
    match = PROGRESS.search(line)
    if not match:
        return None
    try:
        return int(match.group(1)), float(match.group(2)), float(match.group(3))
    except ValueError:
        return None


class ArmProcess:
    """One arm's ``launcher.pretrain`` subprocess; a thread copies its output to the log and parses progress."""

    def __init__(self, spec: ArmSpec, recipe: Path, log: Path, env: dict, curves: dict):
        self.spec = spec
        self.curves = curves  # {"step": [], "loss": [], "grad": []}, shared with the runner
        self.started = time.monotonic()
        self.first_step: Optional[int] = None
        self.last_line = ""
        self.bad_step = ""  # the trainer's guard message, if it stopped the arm
        self.stop_reason: Optional[str] = None
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "a")
        cmd = [sys.executable, "-m", "launcher.pretrain", str(recipe), "--arm", spec.name, "--no-report"]
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.log.flush()
        # own session: the terminal's Ctrl-C reaches only the margin tool, which asks each arm to save and stop
        self.popen = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      start_new_session=True, bufsize=1)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.log.write(line)
            self.log.flush()
            if line.strip():
                self.last_line = line.strip()
                if "BAD STEP" in line:
                    self.bad_step = line.strip()
            got = parse_progress(line)
            if got is not None:
                step, loss, grad = got
                if self.first_step is None:
                    self.first_step = step
                    # a resumed run logs again from its checkpoint: older points past it are replaced
                    while self.curves["step"] and self.curves["step"][-1] >= step:
                        for k in ("step", "loss", "grad"):
                            self.curves[k].pop()
                self.curves["step"].append(step)
                self.curves["loss"].append(loss)
                self.curves["grad"].append(grad)

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def finish(self) -> int:
        rc = self.popen.wait()
        self.thread.join(timeout=10)
        self.log.close()
        return rc


class Runner:
    """Starts, watches, judges and stops the arms of a plan (see the module docstring)."""

    def __init__(self, plan: Plan, trees: dict[int, dict], experiment_dir: Path, max_steps: int, log_interval: int,
                 retry_failed: bool = False):
        from analysis.margin_report import DivergenceRule

        self.plan, self.trees, self.dir = plan, trees, experiment_dir
        self.max_steps, self.log_interval = max_steps, log_interval
        m = plan.config
        self.rule = DivergenceRule(m.loss_margin, m.grad_factor, m.patience, m.min_arms)
        self.state_path = experiment_dir / STATE_FILE
        self.state = load_state(self.state_path)
        self.curves: dict[str, dict] = {}
        self.procs: dict[str, ArmProcess] = {}
        self.stop_requested = 0
        self.started = time.monotonic()
        self.steps_run = 0  # optimizer steps trained by arms of this invocation that have ended (for the ETA)
        self.n_started = 0
        self._last_progress = 0.0
        self.slots = m.processes  # arms at once; lowered after the out-of-memory killer struck
        self.kills: dict[str, int] = {}  # arms killed by a signal in this command, and how often
        if retry_failed:
            again = [k for k, a in self.state["arms"].items() if a.get("status") in ("killed", "failed")]
            for key in again:
                self.state["arms"][key]["status"] = "retry"
            print(f"[margin] --retry-failed: {len(again)} arm(s) start again" + (f": {', '.join(again)}" if again else
                  " (none was killed or failed)"), flush=True)

    def status_of(self, key: str) -> Optional[str]:
        status = self.state["arms"].get(key, {}).get("status")
        if status == "killed" and 0 < self.kills.get(key, 0) <= self.plan.config.retries:
            return None  # killed in this command with retries left: it starts again
        return status

    def _record(self, key: str, **fields) -> None:
        self.state["arms"].setdefault(key, {}).update(fields)
        save_state(self.state_path, self.state)

    def _load_curves(self, key: str) -> dict:
        """Curves an earlier invocation logged (TensorBoard events of the arm's folder), else empty."""
        from launcher.compare import load_scalars
        from launcher.monitors import tags

        curves = {"step": [], "loss": [], "grad": []}
        arm_dir = self.dir / key
        if arm_dir.is_dir():
            scalars = load_scalars(arm_dir)
            loss, grad = scalars.get(tags.TRAIN_LOSS), scalars.get(tags.TRAIN_GRAD_NORM)
            if loss is not None:
                grads = dict(zip(grad[0].tolist(), grad[1].tolist())) if grad is not None else {}
                for s, v in zip(loss[0].tolist(), loss[1].tolist()):
                    curves["step"].append(int(s))
                    curves["loss"].append(float(v))
                    curves["grad"].append(grads.get(s))
        return curves

    def _env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        if "OMP_NUM_THREADS" not in env:  # several arms share the CPU cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.plan.config.processes))
        return env

    def _start(self, key: str) -> None:
        spec = self.plan.arms[key]
        if key not in self.curves:
            self.curves[key] = self._load_curves(key)
        recipe = self.dir / f"seed_{spec.seed}" / "recipe.yaml"
        log = self.dir / f"seed_{spec.seed}" / "logs" / f"{spec.name}.log"
        self.procs[key] = ArmProcess(spec, recipe, log, self._env(), self.curves[key])
        self._record(key, status="running", name=spec.name, seed=spec.seed, attention=spec.attention)
        self.n_started += 1
        print(f"[margin] start {key} ({_cells_text(spec)}) [{self.n_started} started, {len(self.procs)} running]",
              flush=True)

    def _verdicts(self, seed: int) -> dict:
        """The divergence rule on the curves of a seed's arms so far (analysis/margin_report.py)."""
        from analysis.margin_report import judge

        curves = {}
        for key, c in self.curves.items():
            if self.plan.arms[key].seed == seed:
                n = min(len(c["step"]), len(c["loss"]), len(c["grad"]))
                curves[key] = (c["step"][:n], c["loss"][:n], c["grad"][:n])
        return judge(curves, self.rule)

    def _judge_running(self) -> None:
        """Apply the divergence rule to the live curves; stop the arms it finds diverged."""
        for seed in {p.spec.seed for p in self.procs.values()}:
            verdicts = self._verdicts(seed)
            for key, proc in list(self.procs.items()):
                v = verdicts.get(key)
                if v is None or proc.stop_reason is not None or proc.spec.seed != seed:
                    continue
                proc.stop_reason = v.reason
                self._record(key, status="diverged", step=v.step, reason=v.reason)
                print(f"[margin] {key} DIVERGED at step {v.step}: {v.reason}"
                      + ("; stopping it" if self.plan.config.stop_diverged else ""), flush=True)
                if self.plan.config.stop_diverged:
                    proc.signal(signal.SIGTERM)

    def _reap(self) -> None:
        for key, proc in list(self.procs.items()):
            if proc.popen.poll() is None:
                continue
            rc = proc.finish()  # its output is read to the end now
            del self.procs[key]
            c = self.curves[key]
            last = c["step"][-1] if c["step"] else 0
            self.steps_run += max(0, last - (proc.first_step or last))
            if proc.stop_reason is not None:
                continue  # judged diverged already (it saved and stopped)
            verdict = self._verdicts(proc.spec.seed).get(key) if rc in (0, 3) else None
            if verdict is not None:
                self._record(key, status="diverged", step=verdict.step, reason=verdict.reason)
                print(f"[margin] {key} DIVERGED at step {verdict.step}: {verdict.reason}", flush=True)
            elif rc == 0:
                self._record(key, status="survived", step=max(last, self.max_steps))
                print(f"[margin] {key} survived {self.max_steps} steps", flush=True)
            elif rc == 3:  # the trainer's guard stopped it: a non-finite loss or gradient
                why = (proc.bad_step or proc.last_line).split("; the update")[0]
                self._record(key, status="diverged", step=last, reason=f"trainer guard: {why}")
                print(f"[margin] {key} DIVERGED (trainer guard): {why}", flush=True)
            elif rc == 130 or (rc < 0 and self.stop_requested):  # stopped on our signal (before its handler was
                self._record(key, status="interrupted", step=last)  # set, if it died of it): the next command resumes
            elif rc < 0 and not self.stop_requested:  # a signal nobody here sent: kill -9, the out-of-memory killer
                self._killed(key, proc, -rc, last)
            else:
                self._record(key, status="failed", reason=f"exit {rc}: {proc.last_line}")
                print(f"[margin] {key} FAILED (exit {rc}): {proc.last_line} (log: "
                      f"{self.dir / f'seed_{proc.spec.seed}' / 'logs' / (proc.spec.name + '.log')})", flush=True)
                if rc == 2:  # an input problem (data, config) that every arm shares: stop starting more
                    raise ConfigError(f"arm {key} refused its configuration: {proc.last_line}")

    def _killed(self, key: str, proc: ArmProcess, signum: int, last: int) -> None:
        """Name the kill, lower the arms at once after an out-of-memory kill, retry up to margin.retries times."""
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
        likely = " (likely the out-of-memory killer)" if signum == signal.SIGKILL else ""
        self.kills[key] = self.kills.get(key, 0) + 1
        limit = self.plan.config.retries
        checkpoints = self.dir / key / "checkpoints"
        size = sum(p.stat().st_size for p in checkpoints.glob("*") if p.is_file()) if checkpoints.is_dir() else 0
        self._record(key, status="killed", step=last, reason=f"killed by {name}{likely} after step {last}",
                     checkpoints=str(checkpoints) if size else "")
        print(f"[margin] {key} KILLED by {name}{likely} after step {last}, with {len(self.procs)} other arm(s) "
              f"running (log: {self.dir / f'seed_{proc.spec.seed}' / 'logs' / (proc.spec.name + '.log')})", flush=True)
        if signum == signal.SIGKILL and len(self.procs) < self.slots:
            self.slots = max(1, len(self.procs))
            print(f"[margin] at most {self.slots} arm(s) at once from now on (margin.processes="
                  f"{self.plan.config.processes} did not fit in memory)", flush=True)
        if self.kills[key] <= limit:
            print(f"[margin] {key}: starting it again ({self.kills[key]} of margin.retries={limit}), from its last "
                  "checkpoint if it saved one", flush=True)
        else:
            kept = (f"its checkpoints ({size / 2**20:,.0f} MB) stay in {checkpoints} for the retry"
                    if size else "it saved no checkpoint")
            print(f"[margin] {key}: not started again (margin.retries={limit} spent); {kept}: the same command with "
                  "--retry-failed (and a lower margin.processes) continues it", flush=True)

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_progress < self.plan.config.progress_seconds:
            return
        self._last_progress = now
        m = self.plan.config
        statuses = [self.status_of(k) for k in self.plan.arms]
        judged = {s: statuses.count(s) for s in ("survived", "diverged", "failed", "killed")}
        if m.schedule == "full":
            todo = len(next_arms(self.plan, self.status_of, set(self.procs)))
        else:  # the bisections' worst case: arms they may still need
            todo = max(0, sum(worst_case_runs(self.plan)) - sum(judged.values()) - len(self.procs))
        elapsed = now - self.started
        at = {k: (p.curves["step"][-1] if p.curves["step"] else 0) for k, p in self.procs.items()}
        trained = self.steps_run + sum(max(0, at[k] - (p.first_step or at[k])) for k, p in self.procs.items())
        remaining = sum(self.max_steps - s for s in at.values()) + todo * self.max_steps
        # ETA: arm-steps left over the aggregate rate measured so far (the configured estimate before any step)
        rate = trained / elapsed if trained > 0 and elapsed > 0 else m.processes / max(m.step_seconds, 1e-9)
        eta = remaining / rate / 60
        print(f"[margin] {judged['survived']} survived, {judged['diverged']} diverged, {judged['failed']} failed, "
              + (f"{judged['killed']} killed, " if judged["killed"] else "") +
              f"{len(self.procs)} running, up to {todo} to start | {elapsed / 60:.1f} min elapsed, ETA "
              f"<= {eta:.1f} min{'' if trained > 0 else ' (estimated)'}", flush=True)

    def run(self) -> int:
        """Train until every needed arm is judged; returns 0, or 130 when interrupted."""
        m = self.plan.config
        previous = {}

        def on_signal(signum, frame):
            self.stop_requested += 1
            if self.stop_requested == 1:
                print(f"\n[margin] {signal.Signals(signum).name}: asking {len(self.procs)} arm(s) to save a "
                      "checkpoint and stop (Ctrl-C again kills them; the last checkpoints stay)", flush=True)
                for p in self.procs.values():
                    p.signal(signal.SIGTERM)
            else:
                for p in self.procs.values():
                    p.signal(signal.SIGKILL)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
        try:
            for key, arm in self.state["arms"].items():  # an earlier invocation stopped mid-run
                if arm.get("status") == "running":
                    arm["status"] = "interrupted"
                if key in self.plan.arms and key not in self.curves:  # their curves count in the medians
                    self.curves[key] = self._load_curves(key)
            while True:
                if m.max_minutes and not self.stop_requested and time.monotonic() - self.started > 60 * m.max_minutes:
                    print(f"[margin] margin.max_minutes={m.max_minutes:g} spent", flush=True)
                    on_signal(signal.SIGTERM, None)
                self._judge_running()
                self._reap()
                if not self.stop_requested:
                    for key in next_arms(self.plan, self.status_of, set(self.procs)):
                        if len(self.procs) >= self.slots:
                            break
                        self._start(key)
                if not self.procs:
                    break
                self._progress()
                time.sleep(0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for p in self.procs.values():  # an exception above: do not leave arms running unattended
                p.signal(signal.SIGTERM)
            for p in list(self.procs.values()):
                p.finish()
            save_state(self.state_path, self.state)
        self._progress(force=True)
        if self.stop_requested:
            print("[margin] interrupted: the same command resumes the unfinished arms", flush=True)
            return 130
        failed = [k for k in self.plan.arms if self.status_of(k) in ("failed", "killed")]
        if failed:
            print(f"[margin] {len(failed)} arm(s) killed or failed (see their logs): {', '.join(failed)}; the same "
                  "command with --retry-failed starts them again", flush=True)
            return 1
        return 0


def _cells_text(spec: ArmSpec) -> str:
    c = spec.cells[0]
    if len(spec.cells) > 1:
        return f"{c.numerics}, {len(spec.cells)} cells"
    return f"{c.numerics} g={c.gain:g} {c.sign}"


# ----------------------------------------------------------------------------------------------------------------
# Command line


def describe_margin() -> str:
    docs = field_docs(MarginConfig)
    lines = ["margin:  (the grid of a margin run; analysis/margin.py)"]
    for f in dataclasses.fields(MarginConfig):
        lines.append(f"  margin.{f.name} = {getattr(MarginConfig(), f.name)!r}")
        lines.append(f"      {docs.get(f.name, '')}")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m analysis.margin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="recipe name in recipes/ (e.g. margin) or a YAML path")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. margin.gains=[1,20] run.max_steps=500")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the estimate, then exit")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the runs so far")
    parser.add_argument("--retry-failed", action="store_true",
                        help="start the arms that earlier commands left killed or failed again (they resume from "
                             "their last checkpoints)")
    parser.add_argument("--machine", default=None,
                        help="size the grid for this machine instead of the one detected: gpu_gb=80, or "
                             "cpus=2,memory_gb=8 (a CPU machine)")
    parser.add_argument("--help-config", action="store_true", help="list the margin section's fields")
    args = parser.parse_intermixed_args(argv)
    if args.help_config:
        print(describe_margin())
        print("\nEvery other section: python -m launcher.pretrain --help-config")
        sys.exit(0)
    if not args.recipe:
        parser.error("give a recipe, e.g. `python -m analysis.margin margin`")
    return args


def prepare(recipe: str, overrides: list[str], dry_run: bool = False) -> tuple[Plan, dict[int, dict], Path, object]:
    """Load, validate and expand; returns (plan, generated recipe per seed, experiment folder, first arm's config).
    ``dry_run``: data that is not prepared yet is a note, not an error (the plan does not need it)."""
    tree = load_recipe(recipe, overrides)
    if tree.get("arms"):
        raise ConfigError("a margin recipe has no 'arms': the grid (margin.numerics, gains, signs) makes them; "
                          "remove the arms section")
    given = tree.get("attention") or {}
    clash = sorted(set(given) & {"rounding", "fix", *DELTA_FIELDS})
    if clash:
        raise ConfigError(f"attention.{clash[0]} is set by the grid; use margin.numerics / margin.gains / "
                          "margin.signs instead")
    margin = parse_margin(tree)
    plan = expand(margin)
    problem = delta_fields_problem(plan)
    if problem:
        raise ConfigError(problem)
    base = build_config({k: v for k, v in tree.items() if k != "margin"})  # the run sections, before the grid
    if base.monitor.on_warning == "stop":
        raise ConfigError("monitor.on_warning=stop would end margin arms at the early warning, before they survive or "
                          "diverge; use monitor.on_warning=log, checkpoint or switch_fix")
    try:
        _check_data(base)
    except ConfigError as err:
        if not dry_run:
            raise
        print(f"[margin] note: {err}", flush=True)
    experiment_dir = Path(base.run.out_dir) / base.run.experiment
    trees = {seed: seed_tree(tree, plan, seed, experiment_dir) for seed in margin.seeds}
    first = None
    for seed, t in trees.items():
        for name in t["arms"]:
            config = build_config(t, name)  # every arm validated before anything starts
            first = first or config
    return plan, trees, experiment_dir, first


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        plan, trees, experiment_dir, first = prepare(args.recipe, args.overrides, args.dry_run)
        steps = first.run.max_steps
        from analysis.margin_report import write_report

        if args.report_only:
            write_report(experiment_dir, plan, first)
            return 0
        import torch

        problems = environment_problems(first)
        on_gpu = torch.cuda.is_available() and first.run.device != "cpu"
        machine = Machine.parse(args.machine) if args.machine else Machine.detect(on_gpu)
        host_arm_gb = plan.config.arm_host_memory_gb or cpu_arm_memory_gb(first)
        problems += fit_problems(plan, steps, machine, host_arm_gb)
        est = estimate(plan, steps)
        print(f"[margin] {experiment_dir}: {len(plan.config.numerics)} numerics x {len(plan.config.gains)} gains x "
              f"{len(plan.config.signs)} signs x {len(plan.config.seeds)} seed(s), schedule {plan.config.schedule}")
        print(f"[margin] machine: {machine.describe()}" + ("" if machine.gpu_gb else
              f"; one arm needs ~{host_arm_gb:.1f} GB of host memory"
              + (" (margin.arm_host_memory_gb)" if plan.config.arm_host_memory_gb else " (estimated"
                 + ("; vocabulary 50,304 assumed until the data is prepared)" if not first.model.vocab_size and not
                    (Path(first.data.data_dir) / "meta.json").is_file() else ")"))))
        for note in plan.notes:
            print(f"[margin] {note}")
        print(f"[margin] estimate: {est.describe(plan.config, steps)}", flush=True)
        if problems:
            raise ConfigError("this grid cannot run as configured: " + "; ".join(problems))
        if args.dry_run:
            for key, spec in plan.arms.items():
                print(f"  {key}: attention {spec.attention} ({len(spec.cells)} cell(s))")
            return 0
        check_same_recipe(experiment_dir, trees)
        for seed, t in trees.items():
            folder = experiment_dir / f"seed_{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "recipe.yaml").write_text("# generated by python -m analysis.margin; do not edit\n"
                                                + yaml.safe_dump(t, sort_keys=False))
        _prepare_embedded_data(first)
        runner = Runner(plan, trees, experiment_dir, steps, first.run.log_interval, args.retry_failed)
        rc = runner.run()
        if rc != 130:
            write_report(experiment_dir, plan, first)
        return rc
    except ConfigError as err:
        print(f"error: {' '.join(str(err).split())}" if "\n" not in str(err).strip() else f"error: {err}",
              file=sys.stderr)
        return 2


def check_same_recipe(experiment_dir: Path, trees: dict[int, dict]) -> None:
    """Refuse to resume arms that were trained by a different recipe (other than the grid itself)."""
    for seed, t in trees.items():
        path = experiment_dir / f"seed_{seed}" / "recipe.yaml"
        if not path.is_file():
            continue
        old = yaml.safe_load(path.read_text()) or {}
        changed = sorted(k for k in set(old) | set(t) if k != "arms" and old.get(k) != t.get(k))
        if changed:
            raise ConfigError(f"{experiment_dir} holds a margin run of another recipe (sections {', '.join(changed)} "
                              "differ); use another run.experiment, or delete that folder to start over")


def _check_data(config) -> None:
    """Every arm reads the same prepared data: name a missing folder once, before any arm starts."""
    from launcher.prepare_data import EMBEDDED_DATA_DIR

    data_dir = Path(config.data.data_dir)
    if data_dir != Path(EMBEDDED_DATA_DIR) and not (data_dir / "meta.json").is_file():
        raise ConfigError(f"data.data_dir={data_dir} holds no prepared data (meta.json); prepare it with "
                          f"`python -m launcher.prepare_data --source FILES --out {data_dir}` (recipes/margin.yaml "
                          "says how for the dictionary text), or set data.data_dir")


def _prepare_embedded_data(config) -> None:
    """Prepare the embedded corpus once here, not in several arms at once."""
    from launcher.prepare_data import EMBEDDED_DATA_DIR, ensure_prepared

    data_dir = Path(config.data.data_dir)
    if data_dir == Path(EMBEDDED_DATA_DIR) and not (data_dir / "meta.json").is_file():
        ensure_prepared(data_dir)


if __name__ == "__main__":
    sys.exit(main())
