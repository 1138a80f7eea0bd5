"""Compare the arms of an experiment: PNG panels, one self-contained HTML report and a TensorBoard layout.

    python -m launcher.compare runs/<experiment> [--out DIR] [--divergence-threshold 0.05]
                               [--divergence-consecutive 5] [--smoothing 10] [--divergence-tag train/loss]
                               [--reference-arm NAME] [--no-layout]

Every subfolder of the experiment folder that holds TensorBoard event files itself is an arm (``runs/smoke/baseline``,
``runs/smoke/fixed``). The report (default ``runs/<experiment>/report/``) holds one PNG per panel and
``report.html`` with the PNGs embedded (it opens offline, on its own). The text summary is printed and is in the
HTML too. A custom-scalars layout is written into the folder of the first arm (an event file ending in
``.layout``), so that ``tensorboard --logdir runs/<experiment>`` shows the arms overlaid, panel by panel, on its
CUSTOM SCALARS tab.

Divergence criterion (documented in docs/monitoring.md): both arms' ``divergence_tag`` series (default train/loss)
are taken on the steps both logged and smoothed with a trailing mean over ``smoothing`` logged points; the arms
diverge at the first step that starts a run of ``divergence_consecutive`` logged steps on which
|a - b| / min(|a|, |b|) > ``divergence_threshold`` (a non-finite value in either arm counts as above). Every arm is
compared with the reference arm (``baseline`` when present, else the first arm in name order).
"""

from __future__ import annotations

import argparse
import base64
import html
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from launcher import warning_timeline
from launcher.arm_status import Ending, read_ending
from launcher.monitors import tags

EVENTS_GLOB = "events.out.tfevents.*"
# TensorBoard's custom-scalars tab colours runs from this palette (its tensorboardColorBlindAssist) in name order,
# as the arms are ordered here: an arm has one colour in the report and in TensorBoard (baseline orange, fixed blue)
TENSORBOARD_COLORS = ("#ff7043", "#0077bb", "#cc3311", "#33bbee", "#ee3377", "#009988", "#bbbbbb")
LOSS_RISE_NATS = 1.0  # a completed arm whose last logged loss is this far above its first one blew up
MARGIN_STATE_FILE = "margin_state.json"  # analysis/margin_report.py's record, beside a margin run's seed folders
LAYOUT_SUFFIX = ".layout"
DEFAULT_CRITERIA = {"divergence_threshold": 0.05, "divergence_consecutive": 5, "smoothing": 10,
                    "divergence_tag": tags.TRAIN_LOSS, "reference_arm": None}


class CompareError(RuntimeError):
    """The experiment folder cannot be compared; the message says why and what to do."""


Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step


@dataclass
class Arm:
    name: str
    path: Path
    scalars: dict[str, Series] = field(default_factory=dict)
    ending: Ending = field(default_factory=lambda: Ending("unknown", 0))
    attention: dict = field(default_factory=dict)  # the arm's attention section (its config.yaml), if recorded

    def get(self, tag: str) -> Optional[Series]:
        return self.scalars.get(tag)

    def last_step(self) -> int:
        return max((int(s[-1]) for s, _ in self.scalars.values() if len(s)), default=0)


@dataclass
class Divergence:
    arm: str
    reference: str
    step: Optional[int]
    common_steps: int
    max_rel_diff: float
    max_rel_step: Optional[int]
    values: tuple[float, float] = (math.nan, math.nan)


# ----------------------------------------------------------------------------------------------------------------
# Reading


def _event_dirs(arm_dir: Path) -> list[Path]:
    dirs = {p.parent for p in arm_dir.rglob(EVENTS_GLOB) if not p.name.endswith(LAYOUT_SUFFIX)}
    return sorted(dirs)


def _is_arm(folder: Path) -> bool:
    """An arm's folder holds its event files itself (the trainer writes them there), not in a subfolder: a folder
    of experiments must not read as one experiment whose arms are the experiments."""
    return folder.is_dir() and any(not p.name.endswith(LAYOUT_SUFFIX) for p in folder.glob(EVENTS_GLOB))


def _experiments_in(folder: Path) -> list[str]:
    """Subfolders of ``folder`` that hold arms (what `compare` can be given)."""
    try:
        return sorted(p.name for p in folder.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and any(_is_arm(a) for a in p.iterdir()))
    except OSError:
        return []


def load_scalars(run_dir: Path) -> dict[str, Series]:
    """Every scalar tag of the event files under ``run_dir``; a step logged twice (resumed run) keeps the last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, tuple[float, float]]] = {}
    for directory in _event_dirs(run_dir):
        acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            per_step = merged.setdefault(tag, {})
            for event in acc.Scalars(tag):
                old = per_step.get(event.step)
                if old is None or event.wall_time >= old[0]:
                    per_step[event.step] = (event.wall_time, event.value)
    out = {}
    for tag, per_step in merged.items():
        steps = np.array(sorted(per_step), dtype=np.int64)
        out[tag] = (steps, np.array([per_step[s][1] for s in steps], dtype=np.float64))
    return out


def find_arms(experiment_dir: Path) -> list[Arm]:
    """Arms of an experiment folder: its subfolders holding event files, in name order, with their scalars."""
    experiment_dir = Path(experiment_dir)
    if not experiment_dir.is_dir():
        # where experiments are: beside the path, or in the runs/ folder beside it (`compare README.md`)
        parent, names = next(((d, n) for d in (experiment_dir.parent, experiment_dir.parent / "runs")
                              if d.is_dir() and (n := _experiments_in(d))), (None, []))
        parent = Path(os.path.relpath(parent)) if parent is not None and not experiment_dir.is_absolute() else parent
        what = (f"{experiment_dir} is a file, not an experiment folder" if experiment_dir.exists() else
                f"no experiment folder {experiment_dir}")
        hint = (f" Experiments in {parent}: {', '.join(names)}." if names else
                " Give an experiment folder (runs/<experiment>, holding one subfolder per arm).")
        raise CompareError(f"{what}.{hint} To make one, train it, e.g. "
                           "`python -m launcher.pretrain smoke` writes runs/smoke/<arm>/.")
    if _is_arm(experiment_dir):
        raise CompareError(f"{experiment_dir} is the folder of one arm; give its experiment folder: "
                           f"python -m launcher.compare {experiment_dir.parent}")
    inner = _experiments_in(experiment_dir)
    if inner:  # e.g. `compare runs`: each subfolder is an experiment, not an arm
        raise CompareError(f"{experiment_dir} holds experiments ({', '.join(inner)}), not arms; give one of them, "
                           f"e.g. python -m launcher.compare {experiment_dir / inner[0]}")
    arms = [Arm(p.name, p) for p in sorted(experiment_dir.iterdir()) if _is_arm(p)]
    if not arms:
        raise CompareError(f"{experiment_dir} holds no arm with TensorBoard events (expected subfolders like "
                           f"{experiment_dir}/baseline/{EVENTS_GLOB}). Is this the experiment folder "
                           "(runs/<experiment>) and has training logged anything yet?")
    for arm in arms:
        arm.scalars = load_scalars(arm.path)
        arm.attention = _recorded_attention(arm.path)
        bad = arm.get(tags.GUARD_BAD_STEPS)
        arm.ending = read_ending(arm.path, arm.last_step(), int(bad[0][0]) if bad is not None and len(bad[0]) else None)
        loss = arm.get(tags.TRAIN_LOSS)
        if arm.ending.status in ("completed", "unknown") and loss is not None and len(loss[1]) > 1 \
                and loss[1][-1] > loss[1][0] + LOSS_RISE_NATS:
            arm.ending = Ending("loss_rose", arm.ending.step or arm.last_step(),
                                f"its train loss rose from {loss[1][0]:.4g} at step {int(loss[0][0])} to "
                                f"{loss[1][-1]:.4g}", arm.ending.max_steps)
    _margin_verdicts(experiment_dir, arms)
    if not any(arm.scalars for arm in arms):
        raise CompareError(f"the event files under {experiment_dir} hold no scalars yet; train longer than one "
                           "log interval and run the comparison again")
    return arms


def _recorded_attention(arm_dir: Path) -> dict:
    import yaml

    try:
        return dict((yaml.safe_load((arm_dir / "config.yaml").read_text()) or {}).get("attention") or {})
    except (OSError, yaml.YAMLError, TypeError, ValueError):
        return {}


def _margin_verdicts(experiment_dir: Path, arms: list[Arm]) -> None:
    """An arm of a margin run (``<margin experiment>/seed_<N>/<arm>``) that the margin tool judged diverged (and
    stopped) ended by that rule, whatever its process said on the way out."""
    import json

    try:
        state = json.loads((experiment_dir.parent / MARGIN_STATE_FILE).read_text())
    except (OSError, ValueError):
        return
    for arm in arms:
        entry = state.get("arms", {}).get(f"{experiment_dir.name}/{arm.name}", {})
        if entry.get("status") == "diverged":
            arm.ending = Ending("diverged", int(entry.get("step") or arm.last_step()), str(entry.get("reason", "")),
                                arm.ending.max_steps)


def outcome(arms: list[Arm]) -> str:
    """How every arm ended, in one line that leads the summary: blow-ups first."""
    blown = [a for a in arms if a.ending.blew_up]
    unfinished = [a for a in arms if a.ending.status not in ("completed", "unknown") and not a.ending.blew_up]
    parts = []
    if blown:
        parts.append("BLEW UP: " + "; ".join(f"{a.name} {a.ending.describe()}" for a in blown))
    if unfinished:
        parts.append("DID NOT FINISH: " + "; ".join(f"{a.name} {a.ending.describe()}" for a in unfinished))
    done = [a for a in arms if a.ending.status == "completed"]
    if done:
        parts.append(("every arm " if len(done) == len(arms) else "") + "completed: "
                     + ", ".join(f"{a.name} ({a.ending.step} steps)" for a in done))
    unknown = [a.name for a in arms if a.ending.status == "unknown"]
    if unknown:
        parts.append(f"ending not recorded (no status.yaml) for {', '.join(unknown)}")
    return "outcome: " + " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Divergence


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (fewer at the start); non-finite values propagate."""
    window = max(1, int(window))
    if window == 1 or len(values) == 0:
        return values.astype(np.float64)
    csum = np.cumsum(np.insert(values.astype(np.float64), 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def find_divergence(ref: Series, other: Series, threshold: float, consecutive: int, window: int,
                    names: tuple[str, str] = ("reference", "arm")) -> Divergence:
    """First step where ``other`` departs from ``ref`` by the documented criterion (module docstring)."""
    common, ia, ib = np.intersect1d(ref[0], other[0], return_indices=True)
    a, b = smooth(ref[1][ia], window), smooth(other[1][ib], window)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(a - b) / np.minimum(np.abs(a), np.abs(b))
    above = ~np.isfinite(rel) | (rel > threshold)
    step, values = None, (math.nan, math.nan)
    run = 0
    for i, flag in enumerate(above):
        run = run + 1 if flag else 0
        if run >= max(1, consecutive):
            first = i - run + 1
            step, values = int(common[first]), (float(a[first]), float(b[first]))
            break
    finite = np.isfinite(rel)
    max_rel = float(rel[finite].max()) if finite.any() else math.nan
    max_rel_step = int(common[finite][np.argmax(rel[finite])]) if finite.any() else None
    return Divergence(names[1], names[0], step, len(common), max_rel, max_rel_step, values)


# ----------------------------------------------------------------------------------------------------------------
# Panels


def _layers(arms: list[Arm], family: str, stat: str, per_head: bool = False) -> list[int]:
    found = set()
    for arm in arms:
        for tag in arm.scalars:
            t = tags.parse(tag)
            if t and t.family == family and t.stat == stat and (t.head is not None) == per_head:
                found.add(t.layer)
    return sorted(found)


def _heads(arms: list[Arm], layer: int, weight: str) -> list[int]:
    found = set()
    for arm in arms:
        for tag in arm.scalars:
            t = tags.parse(tag)
            if t and t.family == "spectral" and t.layer == layer and t.stat == weight and t.head is not None:
                found.add(t.head)
    return sorted(found)


def growth(series: Optional[Series]) -> float:
    """Last / first finite value of a series (1.0 when it cannot be told)."""
    if series is None:
        return 1.0
    finite = series[1][np.isfinite(series[1])]
    if len(finite) < 1 or finite[0] == 0:
        return 1.0
    return float(finite[-1] / finite[0])


def layer_that_grew_most(arms: list[Arm]) -> Optional[int]:
    """Layer whose W_Q spectral norm grew most (last/first logged value, largest over arms)."""
    best, best_growth = None, -math.inf
    for layer in _layers(arms, "spectral", "wq"):
        g = max(growth(arm.get(tags.spectral(layer, "wq"))) for arm in arms)
        if g > best_growth:
            best, best_growth = layer, g
    return best


def arm_that_grew_most(arms: list[Arm], layer: int) -> tuple[Optional[str], float]:
    """The arm whose W_Q spectral norm of ``layer`` grew most, and by what factor (last / first logged value)."""
    grown = [(growth(arm.get(tags.spectral(layer, "wq"))), arm.name) for arm in arms]
    if not grown:
        return None, 1.0
    g, name = max(grown)
    return name, g


# In the paper, GPT-2 small's loss jumps near step 7,000, after W_Q's spectral norm in layer 1 has grown for
# thousands of steps (Qiu & Yao, arXiv 2510.04212).
FAILURE_STEP_IN_PAPER = 7000
EARLY_DIVERGENCE = ("the arms diverged (dashed line) long before the step at which the paper's failure appeared "
                    f"(near {FAILURE_STEP_IN_PAPER:,}): read the monitors (W_Q growth in an early layer, a one-signed "
                    "delta bias) to tell that mechanism from another cause")


STRESSED_NOTES = {  # the panels of a run whose delta error is amplified (attention.delta_gain > 1)
    "grad_norm": "a gradient norm that climbs in the amplified kept-sign arm only comes with its W_Q growth",
    "spectral": "with the delta error amplified, the mechanism runs at this length: a row that brightens in the "
                "kept-sign arm only (wq, wk of an early layer) is the paper's W_Q growth, sped up",
    "wq_heads": "with the delta error amplified, heads pulling away in the kept-sign arm only, ahead of its loss, are "
                "the paper's signature, sped up",
    "delta_bias": "the amplified arms' delta error is the monitor's too: a drift that keeps one sign is the "
                  "accumulating error the kept sign feeds",
}


def panel_note(steps: int, what: str, diverged: bool = False, stressed: bool = False) -> str:
    """The line under a panel: what a run of ``steps`` steps can and cannot show in it (``what``: the panel kind;
    ``diverged``: the criterion found a divergence; ``stressed``: an arm's delta error is amplified, so the
    mechanism runs within this length)."""
    if stressed and what in STRESSED_NOTES:
        return f"{steps} steps: {STRESSED_NOTES[what]}"
    early = steps < FAILURE_STEP_IN_PAPER // 5
    if what == "loss" and diverged and early:
        return f"{steps} steps: {EARLY_DIVERGENCE}"
    notes = {
        "loss": ("both arms train on the same batches; at this length a gap between them is rounding noise, not the "
                 "failure or its fix (the paper's loss jump came near step 7,000)" if early else
                 "a gap that keeps growing over many logged steps is the divergence; the dashed line marks it"),
        "grad_norm": ("early spikes are ordinary (warmup, first steps); only a sustained rise in one arm matters, "
                      "and that needs thousands of steps" if early else
                      "a sustained rise in one arm only, before its loss jumps, is the paper's sequence"),
        "spectral": ("early training brightens every arm (weights grow from their initialisation; fc_out x10 is "
                     "normal here): compare the arms row by row, not with black. The paper's L01 wq growth in the "
                     "baseline only shows after thousands of steps" if early else
                     "a row that keeps brightening in the baseline but not in the fixed arm (L01 wq in the paper) "
                     "is the failure building up"),
        "wq_heads": ("per-head norms rise together in early training in both arms; the paper's signature, a few "
                     "heads pulling away in the baseline only, needs thousands of steps" if early else
                     "a few heads pulling away in one arm only is the paper's signature"),
        "delta_bias": ("the cumulative delta bias is summed over probe calls: at this length a level reached in the "
                       "first calls and flat afterwards is one early event, in either arm and of either sign; the "
                       "paper's accumulating error is a drift that keeps growing over thousands of steps" if early
                       else "a curve that keeps drifting one way in one arm is the accumulating error"),
        "tie_rate": ("ties are a property of the scores, and the arms' weights part after the first steps: a higher "
                     "tie rate in one arm says nothing about the fix (a fix removes the bias ties cause, e.g. "
                     "fp32_output takes delta from the FP32 O; it does not stop scores from tying)" if early else
                     "the tie rate is the precondition of the bias, in both arms; a fix removes the bias, not ties"),
        "max_logit": ("logits grow while attention sharpens in early training, differently per arm once their "
                      "weights part; not a sign of failure at this length" if early else
                      "logits that keep growing in one arm go with the W_Q growth"),
    }
    return f"{steps} steps: {notes[what]}"


class _Panels:
    """Draws the report's figures; each ``draw_*`` returns (file name, caption)."""

    def __init__(self, arms: list[Arm], out_dir: Path, divergences: list[Divergence], window: int,
                 threshold: float = DEFAULT_CRITERIA["divergence_threshold"]):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.arms = arms
        self.out = out_dir
        self.divergences = divergences
        self.window = window
        self.threshold = threshold
        self.colors = {arm.name: TENSORBOARD_COLORS[i % len(TENSORBOARD_COLORS)] for i, arm in enumerate(arms)}
        self.steps = max(a.last_step() for a in arms)

    def _note(self, fig, what: str, extra: str = "") -> None:
        """The panel's own reading of the run length, under everything else (a PNG is often looked at alone)."""
        import textwrap

        stressed = any(float(a.attention.get("delta_gain", 1.0)) > 1.0 for a in self.arms)
        text = "\n".join(textwrap.wrap(panel_note(self.steps, what, stressed=stressed) + extra,
                                       width=int(fig.get_figwidth() * 15)))
        self._place_note(fig, text)

    def _loss_note(self, fig) -> None:
        import textwrap

        diverged = any(d.step is not None for d in self.divergences)
        reading = stress_reading(self.arms, self.divergences) or endings_reading(self.arms)
        note = f"{self.steps} steps: {reading}" if reading else panel_note(self.steps, "loss", diverged)
        text = "\n".join(textwrap.wrap(note, width=int(fig.get_figwidth() * 15)))
        self._place_note(fig, text)

    def _place_note(self, fig, text: str) -> None:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        bottom = min(ax.get_tightbbox(renderer).transformed(fig.transFigure.inverted()).y0 for ax in fig.axes)
        fig.text(0.01, bottom - 0.02, text, ha="left", va="top", fontsize=8.5, color="#333",
                 bbox=dict(boxstyle="round", fc="#fff8dc", ec="#d9c58b"))

    def _early_share(self, family: str, stat: str, layers: list[int]) -> str:
        """How much of each arm's largest final value was already there at the second probe point: a level
        reached at once and flat after reads as accumulation unless said."""
        parts = []
        for arm in self.arms:
            finals = [(abs(s[1][-1]), layer, s) for layer in layers
                      if (s := arm.get(f"{family}/{tags.layer_key(layer)}/{stat}")) is not None and len(s[1]) > 2
                      and math.isfinite(s[1][-1])]
            if not finals:
                continue
            _, layer, s = max(finals, key=lambda f: f[0])
            if s[1][-1]:
                parts.append(f"{arm.name} {tags.layer_key(layer)} had {100 * s[1][1] / s[1][-1]:.0f}% of its final "
                             f"{s[1][-1]:+.3g} at step {int(s[0][1])}")
        return f". Here: {'; '.join(parts)}" if parts else ""

    def _save(self, fig, name: str) -> str:
        fig.savefig(self.out / name, dpi=110, bbox_inches="tight")
        self.plt.close(fig)
        return name

    def _empty(self, name: str, title: str, why: str) -> str:
        fig, ax = self.plt.subplots(figsize=(7, 2.2))
        ax.axis("off")
        ax.set_title(title)
        ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
        return self._save(fig, name)

    def _mark_divergence(self, ax) -> None:
        for d in self.divergences:
            if d.step is not None:
                ax.axvline(d.step, color=self.colors[d.arm], ls="--", lw=1)
                ax.annotate(f"{d.arm} vs {d.reference}: diverge at {d.step}", (d.step, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(3, -12), textcoords="offset points", fontsize=8, color=self.colors[d.arm])

    def _mark_endings(self, ax) -> None:
        """Where an arm's curve stops short, and why (in the legend): a cross at a bad step's loss (the guard's
        record), a dotted line at the last step of an arm that ended otherwise; a log scale when a blow-up dwarfs
        the curves."""
        for arm in self.arms:
            end = arm.ending
            if end.status in ("completed", "unknown"):
                continue
            c = self.colors[arm.name]
            label = f"{arm.name}: {end.describe()}"
            train = arm.get(tags.TRAIN_LOSS)
            if end.loss is not None and math.isfinite(end.loss):
                ax.plot([end.step], [end.loss], "X", color=c, ms=11, mec="k", zorder=5, ls="none", label=label)
                if train is not None and len(train[0]):
                    ax.plot([train[0][-1], end.step], [train[1][-1], end.loss], ":", color=c, lw=1.2)
                label = None
            ax.axvline(end.step, color=c, ls=":", lw=1.2, label=label)
        losses = [v for arm in self.arms if (t := arm.get(tags.TRAIN_LOSS)) is not None for v in t[1] if v > 0]
        losses += [a.ending.loss for a in self.arms if a.ending.loss is not None and a.ending.loss > 0
                   and math.isfinite(a.ending.loss)]
        if losses and max(losses) > 10 * min(losses):
            ax.set_yscale("log")

    def _per_arm_axes(self, title: str, sharey: bool = True):
        n = len(self.arms)
        fig, axes = self.plt.subplots(1, n, figsize=(5.2 * n, 3.6), sharey=sharey, squeeze=False)
        fig.suptitle(title, y=1.03)
        return fig, axes[0]

    def loss(self) -> tuple[str, str]:
        name = "loss.png"
        if not any(arm.get(tags.TRAIN_LOSS) or arm.get(tags.EVAL_LOSS) for arm in self.arms):
            return self._empty(name, "loss", "no train/loss or eval/loss logged"), "Loss: not logged."
        fig, (ax, diff_ax) = self.plt.subplots(2, 1, figsize=(9, 5.6), sharex=True,
                                               gridspec_kw={"height_ratios": [3, 1.3]})
        ref = self.arms[0] if not self.divergences else next(a for a in self.arms if a.name ==
                                                             self.divergences[0].reference)
        for arm in self.arms:
            c = self.colors[arm.name]
            train = arm.get(tags.TRAIN_LOSS)
            if train is not None:
                interval = int(np.median(np.diff(train[0]))) if len(train[0]) > 1 else 0
                every = f", logged every {interval} steps" if interval else ""
                ax.plot(train[0], train[1], ".-", color=c, lw=1.3, ms=4, label=f"{arm.name} train loss{every}")
                if len(train[1]) >= 3 * self.window:  # a trailing mean, where its window is full, if it adds anything
                    full = smooth(train[1], self.window)[self.window - 1:]
                    ax.plot(train[0][self.window - 1:], full, color=c, lw=3, alpha=0.35,
                            label=f"{arm.name} mean of the last {self.window} logged points")
            ev = arm.get(tags.EVAL_LOSS)
            if ev is not None:
                ax.plot(ev[0], ev[1], "s--", color=c, ms=5, lw=1, label=f"{arm.name} eval loss")
            if arm is not ref and train is not None and ref.get(tags.TRAIN_LOSS) is not None:
                r = ref.get(tags.TRAIN_LOSS)
                common, ia, ib = np.intersect1d(r[0], train[0], return_indices=True)
                with np.errstate(divide="ignore", invalid="ignore"):
                    rel = 100 * (train[1][ib] - r[1][ia]) / np.minimum(np.abs(train[1][ib]), np.abs(r[1][ia]))
                diff_ax.plot(common, rel, ".-", color=c, lw=1, ms=4, label=f"({arm.name} - {ref.name}) / loss")
        self._mark_divergence(ax)
        self._mark_endings(ax)
        diff_ax.axhline(0.0, color="k", lw=0.6)
        for sign in (1, -1):  # the scale a difference has to reach (smoothed, for several steps) to count
            diff_ax.axhline(sign * 100 * self.threshold, color="gray", ls="--", lw=0.8,
                            label="divergence threshold" if sign == 1 else None)
        diff_ax.set_ylabel("train loss\ndifference (%)")
        diff_ax.set_xlabel("step")
        diff_ax.grid(alpha=0.3)
        if len(self.arms) > 1:
            diff_ax.legend(fontsize=7, loc="lower left", ncol=2)
        ax.set_ylabel("cross-entropy")
        ax.set_title("loss: every logged train point, eval points, and the arms' difference")
        short = any(a.ending.status not in ("completed", "unknown") for a in self.arms)
        ax.legend(fontsize=7, ncol=1 if short else 2)
        ax.grid(alpha=0.3)
        self._loss_note(fig)
        return self._save(fig, name), ("Train loss at every logged step (with the trailing mean once its window "
                                       "is full) and eval loss; below, the arms' train-loss difference on common "
                                       "steps; dashed lines mark divergence, dotted lines where an arm stopped "
                                       "(a cross: the loss of the step the guard rejected).")

    def grad_norm(self) -> tuple[str, str]:
        name = "grad_norm.png"
        if not any(arm.get(tags.TRAIN_GRAD_NORM) for arm in self.arms):
            return self._empty(name, "gradient norm", "no train/grad_norm logged"), "Gradient norm: not logged."
        fig, ax = self.plt.subplots(figsize=(9, 3.5))
        for arm in self.arms:
            s = arm.get(tags.TRAIN_GRAD_NORM)
            if s is not None:
                ax.plot(s[0], s[1], ".-", color=self.colors[arm.name], lw=1, ms=4, label=arm.name)
        self._mark_divergence(ax)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("global gradient norm\n(before clipping, log scale)")
        ax.set_title("gradient norm (before clipping)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        self._note(fig, "grad_norm")
        return self._save(fig, name), "Global gradient norm, log scale."

    def spectral_heatmaps(self) -> list[tuple[str, str]]:
        layers = _layers(self.arms, "spectral", "wq")
        if not layers:
            return [(self._empty("spectral_heatmap.png", "spectral norms", "no spectral/* tags logged"),
                     "Spectral norms: not logged (monitor.spectral_interval = 0?).")]
        rows = [(layer, w) for layer in layers for w in tags.WEIGHTS]
        grids = {}
        for arm in self.arms:
            steps = sorted({int(s) for layer, w in rows if arm.get(tags.spectral(layer, w)) is not None
                            for s in arm.get(tags.spectral(layer, w))[0]})
            grid = np.full((len(rows), len(steps)), np.nan)
            col = {s: j for j, s in enumerate(steps)}
            for i, (layer, w) in enumerate(rows):
                series = arm.get(tags.spectral(layer, w))
                if series is None or not len(series[1]):
                    continue
                ratio = series[1] / series[1][0] if series[1][0] else series[1] * np.nan
                for s, r in zip(series[0], ratio):
                    grid[i, col[int(s)]] = r
            grids[arm.name] = (steps, grid)
        from matplotlib.colors import LogNorm

        ref_name = self.divergences[0].reference if self.divergences else self.arms[0].name
        ref_arm = next(a for a in self.arms if a.name == ref_name)

        finite = np.concatenate([g[np.isfinite(g) & (g > 0)] for _, g in grids.values()] + [np.array([1.0])])
        vmax = max(float(finite.max()), 1.01)
        vmin = min(float(finite.min()), 0.99)
        out = []
        for arm in self.arms:
            steps, grid = grids[arm.name]
            name = f"spectral_heatmap_{arm.name}.png"
            if not steps:
                out.append((self._empty(name, f"spectral norms: {arm.name}", "no spectral/* tags in this arm"),
                            f"Spectral norms of {arm.name}: not logged."))
                continue
            fig, ax = self.plt.subplots(figsize=(9, 0.26 * len(rows) + 2.0))
            # cells on the real step axis (edges halfway between logged steps): evenly spaced, round tick labels
            x = np.array(steps, dtype=np.float64)
            mids = (x[1:] + x[:-1]) / 2 if len(x) > 1 else np.array([])
            half = (x[1] - x[0]) / 2 if len(x) > 1 else 0.5
            edges = np.concatenate([[x[0] - half], mids, [x[-1] + (x[-1] - x[-2]) / 2 if len(x) > 1 else x[0] + 0.5]])
            im = ax.pcolormesh(edges, np.arange(len(rows) + 1) - 0.5, np.ma.masked_invalid(grid), cmap="magma",
                               norm=LogNorm(vmin=vmin, vmax=vmax), shading="flat")
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_yticks(range(len(rows)), [f"{tags.layer_key(layer)} {w}" for layer, w in rows], fontsize=8)
            for k in range(1, len(layers)):  # a line between layers
                ax.axhline(k * len(tags.WEIGHTS) - 0.5, color="w", lw=0.6)
            ax.set_xlabel("step")
            ax.set_title(f"{arm.name}: spectral norm / its value at the first logged step (layer x weight)")
            pad = 0.02
            if arm.name != ref_name and ref_name in grids:  # the comparison the eye cannot make across two files
                right = ax.twinx()
                right.set_ylim(ax.get_ylim())
                labels = []
                for i, (layer, w) in enumerate(rows):
                    mine, theirs = arm.get(tags.spectral(layer, w)), ref_arm.get(tags.spectral(layer, w))
                    g_ref = growth(theirs) if theirs is not None else math.nan
                    labels.append(f"{growth(mine) / g_ref:.2f}" if mine is not None and g_ref else "n/a")
                right.set_yticks(range(len(rows)), labels, fontsize=8)
                right.set_ylabel(f"final growth / {ref_name}'s", fontsize=8)
                pad = 0.12
            bar = fig.colorbar(im, ax=ax, fraction=0.03, pad=pad)
            bar.set_label("growth since the first logged step (x, log scale)")
            self._note(fig, "spectral")
            out.append((self._save(fig, name),
                        f"{arm.name}: growth of every weight's spectral norm, one colour scale for all arms. Early "
                        "training brightens every arm; compare the arms' rows (the paper's failure brightens L01 wq "
                        "in the baseline only, over thousands of steps)."))
        return out

    def wq_heads(self, layer: Optional[int]) -> tuple[str, str]:
        name = "wq_heads.png"
        heads = _heads(self.arms, layer, "wq") if layer is not None else []
        if not heads:
            return (self._empty(name, "per-head W_Q spectral norms", "no spectral/Lxx/wq/hNN tags logged"),
                    "Per-head W_Q spectral norms: not logged.")
        where, factor = arm_that_grew_most(self.arms, layer)
        fig, axes = self._per_arm_axes(f"per-head W_Q spectral norms of {tags.layer_key(layer)}, the layer whose "
                                       f"W_Q grew most (x{factor:.3g}, in arm {where})")
        cmap = self.plt.get_cmap("tab20")
        for ax, arm in zip(axes, self.arms):
            for h in heads:
                s = arm.get(tags.spectral(layer, "wq", h))
                if s is not None:
                    ax.plot(s[0], s[1], ".-", color=cmap(h % 20), lw=1, ms=3, label=tags.head_key(h))
            ax.set_title(arm.name)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("spectral norm of the head's\nblock of W_Q")
        axes[-1].legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        self._note(fig, "wq_heads")
        return (self._save(fig, name), f"Spectral norm of each head's block of W_Q in {tags.layer_key(layer)}; "
                "a few heads pulling away is the paper's signature.")

    def per_layer(self, name: str, family: str, stat: str, title: str, caption: str, ylabel: str,
                  note: str = "") -> tuple[str, str]:
        layers = _layers(self.arms, family, stat)
        if not layers:
            return self._empty(name, title, f"no {family}/Lxx/{stat} tags logged"), f"{title}: not logged."
        fig, axes = self._per_arm_axes(title)
        cmap = self.plt.get_cmap("viridis")
        for ax, arm in zip(axes, self.arms):
            points = 0
            for layer in layers:
                tag = f"{family}/{tags.layer_key(layer)}/{stat}"
                s = arm.get(tag)
                if s is not None:  # markers: a run with one or two probe calls still shows them
                    ax.plot(s[0], s[1], "o-", color=cmap(layer / max(1, layers[-1])), lw=2.2 if layer == 1 else 1,
                            ms=3.5, label=tags.layer_key(layer))
                    points = max(points, len(s[0]))
            if family == "delta_bias":
                ax.axhline(0.0, color="k", lw=0.6)
            ax.set_title(f"{arm.name} ({points} probe point{'s' if points != 1 else ''})")
            if not points:
                ax.text(0.5, 0.5, "no probe call yet in this arm\n(shorter than monitor.probe_interval)",
                        ha="center", va="center", transform=ax.transAxes, fontsize=9)
            ax.set_xlabel("step")
            ax.set_xlim(-0.02 * self.steps, 1.02 * self.steps)  # the whole run, also when few probes fell in it
            ax.grid(alpha=0.3)
            fewest = points if ax is axes[0] else min(fewest, points)
        axes[0].set_ylabel(ylabel)
        axes[-1].legend(fontsize=7, ncol=1 + len(layers) // 13, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        if note:
            extra = self._early_share(family, stat, layers) if family == "delta_bias" else ""
            if fewest < 3:
                extra += (f". Only {fewest} probe point(s) in an arm (monitor.probe_interval vs the run's length): "
                          "values, not a trend")
            self._note(fig, note, extra)
        return self._save(fig, name), caption


# ----------------------------------------------------------------------------------------------------------------
# Summary, layout, report


def _fmt(x: float) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.4g}"


def summarize(arms: list[Arm], divergences: list[Divergence], criteria: dict, grew: Optional[int]) -> str:
    """The short text summary printed by the command and shown at the top of the HTML report."""
    window = criteria["smoothing"]
    reference = divergences[0].reference if divergences else arms[0].name
    lines = [outcome(arms), f"arms: {', '.join(a.name for a in arms)} (reference: {reference})"]
    for arm in arms:
        parts = [arm.ending.describe() if arm.ending.status != "unknown" else f"{arm.last_step()} steps"]
        train = arm.get(tags.TRAIN_LOSS)
        if train is not None and len(train[1]):
            parts.append(f"final train loss {_fmt(train[1][-1])} (last logged, step {int(train[0][-1])}; mean of "
                         f"the last {min(window, len(train[1]))} logged points {_fmt(smooth(train[1], window)[-1])})")
            bad = ~np.isfinite(train[1])
            if bad.any():
                parts.append(f"non-finite loss from step {int(train[0][bad][0])}")
        ev = arm.get(tags.EVAL_LOSS)
        if ev is not None and len(ev[1]):
            parts.append(f"eval {_fmt(ev[1][-1])}")
        growths = [(growth(arm.get(tags.spectral(layer, w))), layer, w)
                   for layer in _layers([arm], "spectral", "wq") for w in tags.WEIGHTS]
        if growths:
            g, layer, w = max(growths)
            parts.append(f"largest spectral-norm growth {tags.layer_key(layer)} {w} x{g:.3g}")
        cums = [(arm.get(tags.delta_bias(layer, "cum")), layer) for layer in _layers([arm], "delta_bias", "cum")]
        cums = [(float(s[1][-1]), layer) for s, layer in cums if s is not None and len(s[1])]
        if cums:
            value, layer = max(cums, key=lambda c: abs(c[0]) if math.isfinite(c[0]) else math.inf)
            parts.append(f"largest |cumulative delta bias| {tags.layer_key(layer)} {value:+.3g}")
        ties = arm.get(tags.attn(1, "tie_rate"))
        if ties is not None and len(ties[1]):
            parts.append(f"L01 tie rate mean {_fmt(float(np.nanmean(ties[1])))}")
        lines.append(f"  {arm.name}: " + "; ".join(parts))
    lines.append(f"divergence ({criteria['divergence_tag']} smoothed over {window} logged points, relative "
                 f"difference > {criteria['divergence_threshold']:g} for {criteria['divergence_consecutive']} "
                 "consecutive logged steps):")
    if not divergences:
        lines.append("  only one arm: nothing to compare")
    for d in divergences:
        if d.common_steps == 0:
            lines.append(f"  {d.arm} vs {d.reference}: no common logged steps of {criteria['divergence_tag']}")
        elif d.step is not None:
            lines.append(f"  {d.arm} vs {d.reference}: diverge at step {d.step} "
                         f"({d.reference} {_fmt(d.values[0])}, {d.arm} {_fmt(d.values[1])})")
        else:
            lines.append(f"  {d.arm} vs {d.reference}: no divergence over {d.common_steps} common logged steps "
                         f"(largest relative difference {_fmt(d.max_rel_diff)} at step {d.max_rel_step})")
        ended = [a for a in arms if a.name in (d.arm, d.reference) and a.ending.status not in ("completed", "unknown")]
        if ended:  # the criterion sees only the steps both logged: say where the curves stop and why
            lines.append("    (" + "; ".join(f"{a.name} {a.ending.describe()}" for a in ended)
                         + ": the loss criterion compares only the steps both arms logged)")
    if grew is not None:
        where, factor = arm_that_grew_most(arms, grew)
        lines.append(f"layer whose W_Q spectral norm grew most: {tags.layer_key(grew)} (x{factor:.3g}, in arm {where})")
    lines.append(what_it_can_show(max(a.last_step() for a in arms), any(d.step is not None for d in divergences),
                                  arms, divergences))
    return "\n".join(lines)




def endings_reading(arms: list[Arm]) -> Optional[str]:
    """What the arms' endings show when one did not simply complete (None when every arm completed or none says)."""
    blown = [a for a in arms if a.ending.blew_up]
    others = [a for a in arms if not a.ending.blew_up]
    unfinished = [a for a in others if a.ending.status not in ("completed", "unknown")]
    if blown and not others:
        first = min(blown, key=lambda a: a.ending.step)
        return (f"every arm blew up (first {first.name} at step {first.ending.step}), whatever its attention numerics: "
                "the setting itself is unstable (learning rate, schedule, model), so this run cannot tell the arms' "
                "numerics apart; lower optim.lr or lengthen optim.warmup_steps")
    if blown:
        names = ", ".join(f"{a.name} at step {a.ending.step}" for a in blown)
        survivors = [a for a in others if a.ending.status == "completed"]
        text = f"{names} blew up"
        if survivors:
            text += (f" while {', '.join(f'{a.name} trained on to step {a.ending.step}' for a in survivors)} on the "
                     "same batches: the arms differ only in attention numerics, so the numerics decided it here; "
                     "the monitors (W_Q growth in an early layer, a one-signed delta bias) tell the paper's "
                     "mechanism from another cause")
        if unfinished:
            text += (f"; {', '.join(a.name for a in unfinished)} did not finish, so the comparison is incomplete")
        return text
    if unfinished:
        resume = any(a.ending.status in ("interrupted", "killed", "crashed") for a in unfinished)
        return (f"{', '.join(f'{a.name} {a.ending.describe()}' for a in unfinished)}: the comparison covers only the "
                "steps every arm logged" + ("; finish the arms (the same command resumes from the newest "
                                            "checkpoint) and write the report again" if resume else ""))
    return None


def stress_reading(arms: list[Arm], divergences: list[Divergence]) -> Optional[str]:
    """What a pair of arms with the same amplified delta error (attention.delta_gain > 1), one with its own sign and
    one with random signs, shows: the margin test in miniature (docs/margin.md). None without such a pair."""
    parted_at = {d.arm: d.step for d in divergences if d.step is not None}

    def parted(arm: Arm) -> Optional[int]:  # where the arm left the others: blew up, or diverged from the reference
        return arm.ending.step if arm.ending.blew_up else parted_at.get(arm.name)

    def numerics(arm: Arm) -> tuple:
        return arm.attention.get("rounding"), arm.attention.get("fix"), float(arm.attention.get("delta_gain", 1.0))

    for kept in arms:
        if kept.attention.get("delta_sign") != "kept" or numerics(kept)[2] <= 1.0:
            continue
        twin = next((a for a in arms if a.attention.get("delta_sign") == "random" and numerics(a) == numerics(kept)),
                    None)
        if twin is None:
            continue
        gain, k, r = numerics(kept)[2], parted(kept), parted(twin)
        what = f"the delta error amplified {gain:g}x"
        if k is not None and r is None:
            how = "blew up" if kept.ending.blew_up else "diverged from the reference arm"
            losses = [(a.get(tags.TRAIN_LOSS) or ((), ()))[1] for a in (kept, twin)]
            final = (f" (last train loss {_fmt(losses[0][-1])} against {_fmt(losses[1][-1])})"
                     if all(len(x) for x in losses) else "")
            return (f"{what} with its own sign ({kept.name}) {how} at step {k}, while the same error with random "
                    f"signs ({twin.name}) trained on{final}: the persistent sign, not the error's size, is what "
                    "breaks training (the margin test in miniature, docs/margin.md)")
        if k is not None:
            return (f"{what} broke training with its own sign ({kept.name}, step {k}) and with random signs "
                    f"({twin.name}, step {r}): at this gain the error's size alone breaks training, so this run does "
                    "not show the sign's effect; lower attention.delta_gain")
        if r is not None:
            return (f"{what} broke training with random signs ({twin.name}, step {r}) but not with its own sign "
                    f"({kept.name}): not the paper's mechanism; look at this run's monitors")
        return (f"{what} broke training with neither sign ({kept.name}, {twin.name}) within "
                f"{max(a.last_step() for a in arms)} steps: train longer or raise attention.delta_gain")
    return None


def what_it_can_show(steps: int, diverged: bool = False, arms: Optional[list[Arm]] = None,
                     divergences: Optional[list[Divergence]] = None) -> str:
    """One line on what a comparison of this length can and cannot show (``diverged``: a divergence was found;
    ``arms``: a delta-stress pair, then the arms' endings, come first)."""
    reading = (stress_reading(arms, divergences or []) or endings_reading(arms)) if arms else None
    if reading:
        return f"what this shows: {reading}"
    if steps < FAILURE_STEP_IN_PAPER // 5 and diverged:
        return f"what this shows: {steps} steps; {EARLY_DIVERGENCE}"
    if steps < FAILURE_STEP_IN_PAPER // 5:
        return (f"what this shows: {steps} steps exercise the recipe, both arms' numerics and the monitors; the paper's "
                f"failure needs thousands of steps (GPT-2 small's loss jumps near step {FAILURE_STEP_IN_PAPER:,}), so "
                "a loss difference between the arms at this length is rounding noise, not the failure or its fix")
    if steps < FAILURE_STEP_IN_PAPER:
        return (f"what this shows: {steps} steps are long enough for the leading indicators (a one-signed cumulative "
                "delta bias, W_Q spectral growth in an early layer); the paper's loss jump came later "
                f"(near step {FAILURE_STEP_IN_PAPER:,} of GPT-2 small)")
    return (f"what this shows: {steps} steps reach the length at which the paper's GPT-2 small diverged; a baseline "
            "without divergence is still evidence only for this model, data and learning rate")


def custom_scalar_layout(arms: list[Arm], grew: Optional[int]) -> dict:
    """Custom-scalars layout: one chart per tag, so the arms (TensorBoard runs) are overlaid in each chart."""
    present = set().union(*(arm.scalars for arm in arms))

    def charts(tag_list):
        return {t: ["Multiline", [f"^{re.escape(t)}$"]] for t in tag_list if t in present}

    n_layers = max([*_layers(arms, "spectral", "wq"), *_layers(arms, "attn", "tie_rate"), -1]) + 1
    layout = {
        "1 loss and gradient": charts([tags.TRAIN_LOSS, tags.EVAL_LOSS, tags.TRAIN_GRAD_NORM, tags.TRAIN_LR,
                                        tags.GUARD_BAD_STEPS]),
        "2 spectral norm of W_Q per layer": charts([tags.spectral(i, "wq") for i in range(n_layers)]),
        "4 cumulative delta bias per layer": charts([tags.delta_bias(i, "cum") for i in range(n_layers)]),
        "5 tie rate per layer": charts([tags.attn(i, "tie_rate") for i in range(n_layers)]),
        "6 max logit per layer": charts([tags.attn(i, "max_logit") for i in range(n_layers)]),
    }
    if grew is not None:
        heads = _heads(arms, grew, "wq")
        layout[f"3 {tags.layer_key(grew)}: every weight and every W_Q head"] = charts(
            [tags.spectral(grew, w) for w in tags.WEIGHTS] + [tags.spectral(grew, "wq", h) for h in heads])
    return {k: v for k, v in sorted(layout.items()) if v}


def write_layout(experiment_dir: Path, arm_dir: Path, layout: dict) -> Optional[Path]:
    """Write the layout as an event file in the folder of one arm (``arm_dir``), replacing any written before.
    TensorBoard applies a layout found in any run; kept inside an arm, it adds no run of its own to the list."""
    if not layout:
        return None
    from torch.utils.tensorboard import SummaryWriter

    for old in experiment_dir.rglob(f"{EVENTS_GLOB}{LAYOUT_SUFFIX}"):
        old.unlink()
    writer = SummaryWriter(str(arm_dir), filename_suffix=LAYOUT_SUFFIX)
    writer.add_custom_scalars(layout)
    writer.close()
    return next(arm_dir.glob(f"{EVENTS_GLOB}{LAYOUT_SUFFIX}"), None)


_HOW_TO_READ = """
<ul>
<li><b>Loss</b>: the arms see the same batches, so their curves overlap until the numerics matter. The dashed line
marks the divergence step found by the criterion above.</li>
<li><b>Spectral-norm heatmaps</b>: one row per layer and weight, colour = spectral norm divided by its first logged
value. Early training brightens every arm (weights grow from their initialisation; fc_out x10 in the first hundred
steps is normal), so compare the arms row by row. In the paper's failure, L01 wq (and a few of its heads) keeps
brightening in the baseline, and not in the fixed arm, for thousands of steps before the loss jumps.</li>
<li><b>Per-head W_Q</b>: heads of the layer that grew most; a few heads pulling away is the signature.</li>
<li><b>Cumulative delta bias</b>: running sum of delta_lp - delta_hp on the probe batch. A curve that drifts one way
(persistent sign) and keeps growing over thousands of steps is the accumulating error; a fixed arm should wander
around zero. A level reached in the first probe calls and flat afterwards is one early event, not an accumulation.</li>
<li><b>Tie rate</b>: fraction of probe rows whose maximum score is attained at least twice (within attention.eps),
the precondition of the biased rounding. The arms' scores part once their weights do, so their tie rates differ;
a fix removes the bias that ties cause (fp32_output: delta from the FP32 O; dynamic_max: a shifted maximum), not the
ties.</li>
<li>Each panel says under it what its run length can and cannot show.</li>
</ul>
"""


def _outcome_box(summary: str) -> str:
    """The summary's outcome and reading, on top of the page: red when an arm blew up, amber when arms diverged."""
    lines = [line for line in summary.splitlines() if line.startswith(("outcome: ", "what this shows: "))]
    alarm = any(line.startswith("outcome: BLEW UP") for line in lines)
    parted = re.search(r"^  \S+ vs \S+: diverge at step", summary, re.M) is not None
    style = ("background:#fde2e1;border:2px solid #c0392b" if alarm else
             "background:#fff3cd;border:2px solid #d39e00" if parted else "background:#eef6ee;border:1px solid #9c9")
    paragraphs = [f"<b>{html.escape(line)}</b>" if i == 0 else html.escape(line) for i, line in enumerate(lines)]
    return (f"<div style='{style};padding:0.6em 1em;margin:1em 0'>"
            + "".join(f"<p style='margin:0.3em 0'>{p}</p>" for p in paragraphs) + "</div>")


def _html(title: str, summary: str, figures: list[tuple[str, str]], out_dir: Path) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em}"
             "pre{background:#f4f4f4;padding:1em;white-space:pre-wrap}figure{margin:2em 0}"
             "img{max-width:100%;border:1px solid #ddd}figcaption{color:#444}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>", _outcome_box(summary), "<h2>Summary</h2>",
             f"<pre>{html.escape(summary)}</pre>",
             "<h2>How to read it</h2>", _HOW_TO_READ, "<h2>Panels</h2>"]
    for name, caption in figures:
        data = base64.b64encode((out_dir / name).read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{html.escape(caption)} (<a href='{html.escape(name)}'>{html.escape(name)}</a>)"
                     "</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(experiment_dir, out_dir=None, *, layout: bool = True, quiet: bool = False, **criteria) -> Path:
    """Write the PNG panels, report.html (returned) and summary.txt of an experiment; print the summary.

    ``criteria``: divergence_threshold, divergence_consecutive, smoothing, divergence_tag, reference_arm (see the
    module docstring). Raises CompareError (with what to do) for a missing folder or one without arms/events."""
    unknown = set(criteria) - set(DEFAULT_CRITERIA)
    if unknown:
        raise CompareError(f"unknown criteria {', '.join(sorted(unknown))}; known: {', '.join(DEFAULT_CRITERIA)}")
    crit = {**DEFAULT_CRITERIA, **{k: v for k, v in criteria.items() if v is not None}}
    if not float(crit["divergence_threshold"]) > 0:
        raise CompareError(f"divergence_threshold={crit['divergence_threshold']} must be > 0 (e.g. 0.05 = 5%)")
    if int(crit["divergence_consecutive"]) < 1 or int(crit["smoothing"]) < 1:
        raise CompareError("divergence_consecutive and smoothing must be >= 1 (1 = no smoothing)")
    experiment_dir = Path(experiment_dir)
    arms = find_arms(experiment_dir)
    names = [a.name for a in arms]
    ref_name = crit["reference_arm"] or ("baseline" if "baseline" in names else names[0])
    if ref_name not in names:
        raise CompareError(f"reference arm {ref_name!r} is not among the arms {', '.join(names)}")
    ref = next(a for a in arms if a.name == ref_name)
    divergences = []
    tag = crit["divergence_tag"]
    for arm in arms:
        if arm is ref:
            continue
        a, b = ref.get(tag), arm.get(tag)
        if a is None or b is None:
            divergences.append(Divergence(arm.name, ref.name, None, 0, math.nan, None))
            continue
        divergences.append(find_divergence(a, b, float(crit["divergence_threshold"]),
                                           int(crit["divergence_consecutive"]), int(crit["smoothing"]),
                                           (ref.name, arm.name)))
    out_dir = Path(out_dir) if out_dir is not None else experiment_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    grew = layer_that_grew_most(arms)
    panels = _Panels(arms, out_dir, divergences, int(crit["smoothing"]), float(crit["divergence_threshold"]))
    figures = [panels.loss(), panels.grad_norm(), *panels.spectral_heatmaps(), panels.wq_heads(grew),
               panels.per_layer("delta_bias_cum.png", "delta_bias", "cum", "cumulative delta bias per layer",
                                "Running sum over probe calls of sum_T(delta_lp - delta_hp), per layer (summed over "
                                "heads). One sign that keeps growing = the paper's accumulating error.",
                                "sum of delta_lp - delta_hp", "delta_bias"),
               panels.per_layer("tie_rate.png", "attn", "tie_rate", "tie rate per layer (probe batch)",
                                "Fraction of probe rows whose maximum score is attained >= 2 times within "
                                "attention.eps, in the run's score precision. A fix removes the bias ties cause "
                                "(fp32_output: delta from the FP32 O), not the ties.", "tie rate", "tie_rate"),
               panels.per_layer("max_logit.png", "attn", "max_logit", "maximum attention logit per layer",
                                "Largest scaled score alpha q.k on the probe batch.", "max logit", "max_logit"),
               warning_timeline.panel(arms, out_dir)]
    summary = summarize(arms, divergences, crit, grew) + "\n" + warning_timeline.summary_lines(arms)
    (out_dir / "summary.txt").write_text(summary + "\n")
    report = out_dir / "report.html"
    report.write_text(_html(f"{experiment_dir.name}: {' vs '.join(names)}", summary, figures, out_dir))
    layout_file = write_layout(experiment_dir, arms[0].path, custom_scalar_layout(arms, grew)) if layout else None
    if not quiet:
        print(summary)
        print(f"report: {report}")
        if layout_file is not None:
            print(f"TensorBoard: tensorboard --logdir {experiment_dir}  (CUSTOM SCALARS tab: arms overlaid)")
    return report


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", help="experiment folder, e.g. runs/smoke")
    parser.add_argument("--out", default=None, help="output folder (default: <experiment>/report)")
    parser.add_argument("--divergence-threshold", type=float, default=None,
                        help=f"relative difference of the smoothed series (default {DEFAULT_CRITERIA['divergence_threshold']})")
    parser.add_argument("--divergence-consecutive", type=int, default=None,
                        help=f"logged steps in a row above the threshold (default {DEFAULT_CRITERIA['divergence_consecutive']})")
    parser.add_argument("--smoothing", type=int, default=None,
                        help=f"trailing-mean window in logged points, 1 = raw (default {DEFAULT_CRITERIA['smoothing']})")
    parser.add_argument("--divergence-tag", default=None, help="scalar compared (default train/loss)")
    parser.add_argument("--reference-arm", default=None, help="arm the others are compared with (default baseline)")
    parser.add_argument("--no-layout", action="store_true", help="do not write the TensorBoard custom-scalars layout")
    args = parser.parse_args(argv)
    try:
        write_report(args.experiment, args.out, layout=not args.no_layout,
                     divergence_threshold=args.divergence_threshold,
                     divergence_consecutive=args.divergence_consecutive, smoothing=args.smoothing,
                     divergence_tag=args.divergence_tag, reference_arm=args.reference_arm)
    except CompareError as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
