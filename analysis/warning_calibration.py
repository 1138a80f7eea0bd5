"""Calibrate the early warning on margin grids and judge it on grids it has not seen.

    python -m analysis.warning_calibration --calibrate EXPERIMENT [...] --holdout EXPERIMENT [...]
                                           [--max-false-alarms 0.1] [--out DIR] [monitor.warning_<field>=value ...]

Each EXPERIMENT is the folder of a margin run (``python -m analysis.margin``; its report writes
``margin_report/arms.json``: every arm's numerics, gain, sign, seed, whether and when it diverged, and whether it is
the arm one gain below its series' margin). For every signal of the rule (launcher/monitors/warning.py: SIGNALS) the
logged series of each arm are replayed through the live rule's code (``warning.replay``), once, and the signal's
threshold is chosen on the calibration arms: among the thresholds whose false alarms stay within
``--max-false-alarms`` of the stable arms, the one that warns the most diverging arms in time (lead >= the target
lead, below) in the worse of the two roundings, then the most in all, then the fewest false alarms, then the longest
median lead; each threshold tried sits in the middle between two arms' largest firing values, so the choice keeps
the widest margin to the arms on either side. The chosen threshold is then applied, unchanged, to the held-out arms. The rule's other fields
(layer, patience, after_step, window, baseline) come from the overrides (defaults: MonitorConfig's).

Reported per signal, for both sets (:class:`Score`): diverging arms warned before they diverged, for paper and fa2
rounding apart; lead time median and minimum; false alarms on stable arms and on the arms one gain below the margin;
and whether issue 33's targets hold: >= 80% of diverging arms warned in both roundings, median lead >= min(300, 25%
of the median steps to divergence), false alarms <= 10% of stable arms. Also the rule that fires on any signal at
its chosen threshold. Output: ``<out>/calibration.md`` (default ``<first holdout>/warning_calibration``) and one
figure per signal (``signal_<name>.png``: its value per arm over steps, the chosen threshold, divergence steps).

Which signals need more than the logged scalars: none, at the logged monitor intervals. Every signal is a function of
logged tags (tie rates, per-head W_Q norms, whole W_Q norms of every layer, delta-bias sums and cosines, per-head
Q-K update and activation spectra). Recomputing the Q-K update over another interval, other layers or another
spectral statistic needs the weights at those steps (checkpoints), which margin runs do not keep.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from launcher.monitors import tags, warning as rules
from launcher.monitors.warning import SIGNALS, Replay, WarningRule, first_onset

ARMS_FILE = "arms.json"  # in <experiment>/margin_report/, written by analysis/margin_report.py
TARGET_WARNED = 0.8
TARGET_LEAD_STEPS = 300
TARGET_LEAD_SHARE = 0.25
TARGET_FALSE_ALARMS = 0.10


class CalibrationError(RuntimeError):
    """An input the calibration cannot use; the message says what to do."""


@dataclass
class ArmOutcome:
    """What a margin arm came to (the margin report's verdict), as the calibration needs it."""

    key: str
    numerics: str
    gain: Optional[float]
    sign: Optional[str]
    seed: int
    status: str  # diverged | survived
    step: int  # divergence step, or the steps it trained
    below_margin: bool = False  # survived at the gain just below its series' smallest diverging gain

    @property
    def rounding(self) -> str:
        return self.numerics.split("/")[0]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def lead_target(divergence_step: int) -> float:
    """The lead a warning needs to be useful for an arm that diverged at ``divergence_step``."""
    return min(TARGET_LEAD_STEPS, TARGET_LEAD_SHARE * divergence_step)


@dataclass
class Score:
    """How one rule did on a set of arms."""

    diverged: dict = field(default_factory=dict)  # rounding -> diverging arms
    warned: dict = field(default_factory=dict)  # rounding -> warned before their divergence
    useful: dict = field(default_factory=dict)  # rounding -> warned at least lead_target steps before
    leads: list = field(default_factory=list)
    divergence_steps: list = field(default_factory=list)
    stable: int = 0
    false_alarms: int = 0
    below: int = 0
    below_false_alarms: int = 0

    @classmethod
    def of(cls, arms: list[ArmOutcome], onsets: dict[str, Optional[int]]) -> "Score":
        score = cls()
        for arm in arms:
            onset = onsets.get(arm.key)
            if arm.status == "diverged":
                r = arm.rounding
                score.diverged[r] = score.diverged.get(r, 0) + 1
                score.divergence_steps.append(arm.step)
                if onset is not None and onset <= arm.step:
                    score.warned[r] = score.warned.get(r, 0) + 1
                    score.leads.append(arm.step - onset)
                    if arm.step - onset >= lead_target(arm.step):
                        score.useful[r] = score.useful.get(r, 0) + 1
            else:
                score.stable += 1
                score.false_alarms += onset is not None
                if arm.below_margin:
                    score.below += 1
                    score.below_false_alarms += onset is not None
        return score

    def share(self, rounding: str, what: str = "warned") -> Optional[float]:
        n = self.diverged.get(rounding, 0)
        return getattr(self, what).get(rounding, 0) / n if n else None

    def worst_share(self, what: str) -> float:
        shares = [self.share(r, what) for r in self.diverged]
        return min(shares) if shares else 0.0

    @property
    def median_lead(self) -> Optional[float]:
        return statistics.median(self.leads) if self.leads else None

    def targets(self) -> tuple[bool, str]:
        """(all of issue 33's targets met, which are missed)."""
        missed = []
        for r in ("paper", "fa2"):
            share = self.share(r)
            if share is not None and share < TARGET_WARNED:
                missed.append(f"{r} warned {share:.0%} < {TARGET_WARNED:.0%}")
        if self.divergence_steps:
            need = min(TARGET_LEAD_STEPS, TARGET_LEAD_SHARE * statistics.median(self.divergence_steps))
            if self.median_lead is None or self.median_lead < need:
                missed.append(f"median lead {self.median_lead if self.median_lead is not None else 'none'} < {need:g}")
        if self.stable and self.false_alarms / self.stable > TARGET_FALSE_ALARMS:
            missed.append(f"false alarms {self.false_alarms / self.stable:.0%} > {TARGET_FALSE_ALARMS:.0%}")
        if not self.divergence_steps:
            missed.append("no diverging arm")
        return not missed, "; ".join(missed)

    def cells(self) -> list[str]:
        def warned(r):
            n = self.diverged.get(r, 0)
            return "-" if not n else f"{self.warned.get(r, 0)} of {n} ({self.useful.get(r, 0)} in time)"

        leads = "-" if not self.leads else f"{self.median_lead:g} / {min(self.leads)}"
        met, missed = self.targets()
        return [warned("paper"), warned("fa2"), leads, f"{self.false_alarms} of {self.stable}",
                f"{self.below_false_alarms} of {self.below}", "yes" if met else f"no: {missed}"]


SCORE_HEADER = ["paper arms warned", "fa2 arms warned", "lead median / min (steps)", "false alarms (stable)",
                "false alarms (one gain below the margin)", "targets met"]


def table(rows: list[tuple[str, str, Score]]) -> list[str]:
    """Markdown table lines of (rule, threshold, score) rows."""
    lines = ["| rule | threshold | " + " | ".join(SCORE_HEADER) + " |", "|---" * (len(SCORE_HEADER) + 2) + "|"]
    lines += [f"| {name} | {threshold} | " + " | ".join(score.cells()) + " |" for name, threshold, score in rows]
    return lines


# ----------------------------------------------------------------------------------------------------------------
# Replays


def onsets_of(replays: dict[str, Replay], signal: str, threshold: float, rule: WarningRule) -> dict[str, Optional[int]]:
    """First onset per arm of the rule with only ``signal`` enabled, at ``threshold``."""
    return {key: first_onset(r.readings[signal], threshold, rule.patience, rule.after_step, r.measured[signal])
            for key, r in replays.items()}


def any_of(per_signal: list[dict[str, Optional[int]]]) -> dict[str, Optional[int]]:
    """Onsets of a rule that fires on any of several signals: the earliest of theirs (the warning first turns on at
    the first step where some condition reached its patience)."""
    keys = set().union(*per_signal) if per_signal else set()
    return {k: min((o[k] for o in per_signal if o.get(k) is not None), default=None) for k in keys}


def rule_scores(rule: WarningRule, replays: dict[str, Replay], arms: list[ArmOutcome]) -> list[tuple[str, str, Score]]:
    """Rows for the margin report: each enabled signal alone at its threshold, then the rule itself."""
    rows = [(signal, f"{threshold:g}", Score.of(arms, onsets_of(replays, signal, threshold, rule)))
            for signal, threshold in rule.thresholds().items()]
    if len(rows) > 1:
        rows.append(("the rule (any of the above)", "", Score.of(arms, {k: r.first for k, r in replays.items()})))
    return rows


def _largest_firing(readings: list, measured: list[int], rule: WarningRule) -> Optional[float]:
    """The largest threshold at which the signal still fires on this arm (its patience-long runs' minima)."""
    by_step = {r.step: r.value for r in readings}
    best, window = None, []
    for step in measured:
        value = by_step.get(step)
        if value is None or step < rule.after_step:
            window = []
            continue
        window = (window + [value])[-rule.patience:]
        if len(window) == rule.patience:
            low = min(window)
            best = low if best is None else max(best, low)
    return best


def candidates(replays: dict[str, Replay], signal: str, rule: WarningRule) -> list[float]:
    """Thresholds worth trying: the outcome changes only where a threshold passes some arm's largest firing
    threshold, so one threshold per interval between them, in its middle (the widest margin on both sides)."""
    tops = sorted({t for r in replays.values()
                   if (t := _largest_firing(r.readings[signal], r.measured[signal], rule)) is not None
                   and math.isfinite(t) and t > 0})
    return ([tops[0] / 2] if tops else []) + [(a + b) / 2 for a, b in zip(tops, tops[1:])]


def choose(replays: dict[str, Replay], arms: list[ArmOutcome], signal: str, rule: WarningRule,
           max_false_alarms: float) -> Optional[tuple[float, Score]]:
    """The threshold of ``signal`` chosen on these arms (the module docstring), with its score; None when no
    threshold keeps the false alarms within bounds and warns an arm."""
    best = None
    for threshold in candidates(replays, signal, rule):
        if threshold <= 0:
            continue  # 0 switches a signal off in the config
        score = Score.of(arms, onsets_of(replays, signal, threshold, rule))
        if score.stable and score.false_alarms > max_false_alarms * score.stable:
            continue
        if not score.leads:
            continue
        key = (score.worst_share("useful"), sum(score.useful.values()), sum(score.warned.values()),
               -score.false_alarms, score.median_lead or 0, threshold)
        if best is None or key > best[0]:
            best = (key, threshold, score)
    return None if best is None else (best[1], best[2])


# ----------------------------------------------------------------------------------------------------------------
# Loading


def load_arms(experiment_dir: Path) -> list[ArmOutcome]:
    path = Path(experiment_dir) / "margin_report" / ARMS_FILE
    if not path.is_file():
        raise CalibrationError(f"{path} is missing: write the margin report of {experiment_dir} first "
                               f"(python -m analysis.margin <its recipe> --report-only, with the overrides it ran "
                               "with)")
    arms = [ArmOutcome(**a) for a in json.loads(path.read_text())]
    return [a for a in arms if a.status in ("diverged", "survived")]


def replay_arms(experiment_dir: Path, arms: list[ArmOutcome], rule: WarningRule) -> dict[str, Replay]:
    from launcher.compare import load_scalars

    out = {}
    for arm in arms:
        folder = Path(experiment_dir) / arm.key
        if not folder.is_dir():
            raise CalibrationError(f"{folder} is missing: {ARMS_FILE} lists arm {arm.key}, whose event files must "
                                   "be beside it")
        out[_qualified(experiment_dir, arm.key)] = rules.replay(rule, load_scalars(folder))
    return out


def _qualified(experiment_dir: Path, key: str) -> str:
    return f"{Path(experiment_dir).name}/{key}"


def load_set(folders: list[Path], rule: WarningRule) -> tuple[list[ArmOutcome], dict[str, Replay]]:
    arms, replays = [], {}
    for folder in folders:
        mine = load_arms(folder)
        replays.update(replay_arms(folder, mine, rule))
        for arm in mine:
            arm.key = _qualified(folder, arm.key)
        arms += mine
    return arms, replays


# ----------------------------------------------------------------------------------------------------------------
# The calibration


@dataclass
class Calibrated:
    signal: str
    threshold: Optional[float]
    calibration: Score
    holdout: Score
    logged: bool = True  # the calibration arms logged what the signal reads


def calibrate(cal: tuple[list, dict], held: tuple[list, dict], rule: WarningRule,
              max_false_alarms: float) -> list[Calibrated]:
    """Per signal: the threshold chosen on ``cal``, its score there and on ``held``; then the rule of every signal
    that got a threshold (named ``any``)."""
    (cal_arms, cal_replays), (held_arms, held_replays) = cal, held
    out, chosen = [], {}
    for signal in SIGNALS:
        picked = choose(cal_replays, cal_arms, signal, rule, max_false_alarms)
        if picked is None:
            logged = any(r.readings[signal] for r in cal_replays.values())
            out.append(Calibrated(signal, None, Score.of(cal_arms, {}), Score.of(held_arms, {}), logged))
            continue
        threshold, score = picked
        chosen[signal] = threshold
        out.append(Calibrated(signal, threshold, score,
                              Score.of(held_arms, onsets_of(held_replays, signal, threshold, rule))))
    if len(chosen) > 1:
        cal_on = any_of([onsets_of(cal_replays, s, t, rule) for s, t in chosen.items()])
        held_on = any_of([onsets_of(held_replays, s, t, rule) for s, t in chosen.items()])
        out.append(Calibrated("any", None, Score.of(cal_arms, cal_on), Score.of(held_arms, held_on)))
    return out


def best_out_of_sample(results: list[Calibrated]) -> Optional[Calibrated]:
    """The single-signal rule that did best on the held-out arms: targets met first, then the worse rounding's share
    warned in time, then all warned in time, then the fewest false alarms, then the longest median lead."""
    ranked = [r for r in results if r.threshold is not None]
    if not ranked:
        return None
    return max(ranked, key=lambda r: (r.holdout.targets()[0], r.holdout.worst_share("useful"),
                                      sum(r.holdout.useful.values()), -r.holdout.false_alarms,
                                      r.holdout.median_lead or 0))


def _figure(signal: str, threshold: Optional[float], sets: list[tuple[str, list, dict]], rule: WarningRule,
            out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(sets), figsize=(7 * len(sets), 3.8), squeeze=False, sharey=True)
    for j, (name, arms, replays) in enumerate(sets):
        for k, rounding in enumerate(("paper", "fa2")):
            ax = axes[0, 2 * j + k]
            for arm in arms:
                if arm.rounding != rounding:
                    continue
                readings = replays[arm.key].readings[signal]
                if not readings:
                    continue
                steps = [r.step for r in readings]
                values = [r.value if math.isfinite(r.value) else float("nan") for r in readings]
                color = "tab:red" if arm.status == "diverged" else "tab:orange" if arm.below_margin else "tab:blue"
                ax.plot(steps, values, color=color, lw=0.9, alpha=0.8,
                        ls="--" if arm.sign == "random" else "-")
                if arm.status == "diverged":
                    ax.axvline(arm.step, color=color, ls=":", lw=0.6)
            if threshold is not None:
                ax.axhline(threshold, color="k", lw=1)
            ax.axvline(rule.after_step, color="0.6", lw=0.8)
            ax.set_title(f"{name}: {rounding}", fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(signal)
    chosen = f"{threshold:.4g}" if threshold is not None else "none"
    fig.suptitle(f"{signal} of {tags.layer_key(rule.layer)}: {SIGNALS[signal]}\nred diverged (dotted: its step), "
                 "orange one gain below the margin, blue stable; dashed: random sign; black: the threshold chosen "
                 f"({chosen}); grey: warning_after_step", fontsize=8)
    fig.tight_layout()
    name = f"signal_{signal}.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def write(results: list[Calibrated], cal_dirs: list[Path], held_dirs: list[Path], rule: WarningRule,
          max_false_alarms: float, out: Path, figures: list[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    md = ["# Early-warning calibration", "",
          f"Calibration grids: {', '.join(map(str, cal_dirs))}. Held-out grids: {', '.join(map(str, held_dirs))}.",
          f"Rule structure: layer {rule.layer}, patience {rule.patience}, from step {rule.after_step}, window "
          f"{rule.window}, baseline {rule.baseline}. Threshold per signal chosen on the calibration grids with false "
          f"alarms <= {max_false_alarms:.0%} of their stable arms (analysis/warning_calibration.py); 'in time' = "
          f"lead >= min({TARGET_LEAD_STEPS}, {TARGET_LEAD_SHARE:.0%} of the steps to divergence).", "",
          "## Calibration grids (in-sample)", ""]

    def threshold(r):
        if r.signal == "any":
            return "each signal's"
        if r.threshold is None:
            return "none fits" if r.logged else "not logged"
        return f"{r.threshold:.4g}"

    md += table([(r.signal, threshold(r), r.calibration) for r in results])
    md += ["", "## Held-out grids (thresholds unchanged)", ""]
    md += table([(r.signal, threshold(r), r.holdout) for r in results])
    best = best_out_of_sample(results)
    md += [""]
    if best is not None:
        met = best.holdout.targets()
        md += [f"Best single signal out of sample: **{best.signal} > {best.threshold:.4g}** "
               f"(targets {'met' if met[0] else 'missed: ' + met[1]}); as overrides: "
               f"`monitor.warning_{best.signal}={best.threshold:.4g}` and 0 for the other thresholds."]
    md += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    path = out / "calibration.md"
    path.write_text("\n".join(md) + "\n")
    print("\n".join(line for line in md if not line.startswith("![")))
    print(f"[calibration] {path}", flush=True)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.warning_calibration",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", nargs="+", required=True, type=Path, help="margin experiment folders")
    parser.add_argument("--holdout", nargs="+", required=True, type=Path, help="margin experiment folders")
    parser.add_argument("--max-false-alarms", type=float, default=TARGET_FALSE_ALARMS,
                        help=f"largest share of stable calibration arms a threshold may alarm (default "
                             f"{TARGET_FALSE_ALARMS})")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default <first holdout>/"
                                                               "warning_calibration)")
    parser.add_argument("overrides", nargs="*", help="monitor.warning_<field>=value for the rule's structure")
    args = parser.parse_args(argv)
    from launcher.config import ConfigError, MonitorConfig, _build, parse_overrides

    # section.field=value after a folder list belongs to the overrides, not to the list
    def override(p: Path) -> bool:
        return re.match(r"^[a-z_]+\.[a-z_0-9]+=", str(p)) is not None

    args.overrides += [str(p) for p in args.calibrate + args.holdout if override(p)]
    args.calibrate = [p for p in args.calibrate if not override(p)]
    args.holdout = [p for p in args.holdout if not override(p)]
    try:
        tree = parse_overrides(args.overrides)
        if set(tree) - {"monitor"}:
            raise ConfigError(f"only monitor.* overrides are used here, not {', '.join(sorted(set(tree) - {'monitor'}))}")
        rule = WarningRule.from_monitor(_build(MonitorConfig, tree.get("monitor", {}), "monitor"))
        overlap = {p.resolve() for p in args.calibrate} & {p.resolve() for p in args.holdout}
        if overlap:
            raise ConfigError(f"{', '.join(map(str, sorted(overlap)))} is in both --calibrate and --holdout: a "
                              "held-out grid must be one the thresholds were not chosen on")
        cal, held = load_set(args.calibrate, rule), load_set(args.holdout, rule)
        results = calibrate(cal, held, rule, args.max_false_alarms)
        out = args.out or args.holdout[0] / "warning_calibration"
        out.mkdir(parents=True, exist_ok=True)
        figures = [_figure(r.signal, r.threshold, [("calibration", *cal), ("held out", *held)], rule, out)
                   for r in results if r.signal in SIGNALS and r.logged]
        write(results, args.calibrate, args.holdout, rule, args.max_false_alarms, out, figures)
    except (ConfigError, CalibrationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
