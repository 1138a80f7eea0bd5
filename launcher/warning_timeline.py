"""The early warning of each arm beside its loss, for the comparison report (launcher/compare.py).

For every arm: when ``warning/on`` was up during training (the live rule's own flag), and at each onset which
signal fired on which layer and head and whether the numerics signals agreed, from a replay of the arm's logged
series through the rule of its own ``config.yaml`` (launcher/monitors/warning.py: ``replay``; the same code as the
live rule, so the same onsets). Arms trained without the rule, or whose thresholds were all 0, say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from launcher.monitors import tags
from launcher.monitors.warning import Onset, WarningRule, replay

PANEL = "warning_timeline.png"


def arm_rule(arm_dir: Path) -> Optional[WarningRule]:
    """The warning rule of the run in ``arm_dir`` (its config.yaml), or None when it has no readable config."""
    from launcher.config import ConfigError, MonitorConfig, _build

    path = Path(arm_dir) / "config.yaml"
    try:
        monitor = (yaml.safe_load(path.read_text()) or {}).get("monitor") or {}
        return WarningRule.from_monitor(_build(MonitorConfig, monitor, "monitor"))
    except (OSError, yaml.YAMLError, ConfigError, TypeError):
        return None


def arm_onsets(arm) -> Optional[list[Onset]]:
    """The onsets of the arm's own rule over its logged series (None: no rule to replay)."""
    rule = arm_rule(arm.path)
    if rule is None or not rule.enabled:
        return None
    return replay(rule, arm.scalars).onsets


def too_short(arm) -> Optional[int]:
    """The rule's first step (monitor.warning_after_step) when the arm's logged steps all lie before it, else None:
    such a run could not warn whatever happened (e.g. README command 1's 120 steps against step 200)."""
    rule, flag = arm_rule(arm.path), arm.get(tags.WARNING)
    if rule is None or flag is None or not len(flag[0]) or flag[0][-1] >= rule.after_step:
        return None
    return rule.after_step


def switches(arm_dir: Path) -> list[dict]:
    """The arm's changes.yaml entries made by monitor.on_warning=switch_fix (launcher/on_warning.py)."""
    from launcher.on_warning import SOURCE

    path = Path(arm_dir) / "changes.yaml"
    if not path.is_file():
        return []
    try:
        entries = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError):
        return []
    return [e for e in entries if isinstance(e, dict) and e.get("by") == SOURCE]


def summary_lines(arms) -> str:
    """One line per arm for the report's summary: its early-warning onsets and what fired."""
    lines = ["early warning (warning/on; launcher/monitors/warning.py):"]
    for arm in arms:
        flag = arm.get(tags.WARNING)
        onsets, first_step = arm_onsets(arm), too_short(arm)
        if onsets is None or flag is None:
            lines.append(f"  {arm.name}: not evaluated (no warning rule in its config, or warning/on not logged)")
        elif not onsets and first_step is not None:
            lines.append(f"  {arm.name}: no onset possible: the rule starts at step {first_step} "
                         f"(monitor.warning_after_step), after this run's last monitor step {int(flag[0][-1])}")
        elif not onsets:
            lines.append(f"  {arm.name}: no onset over {len(flag[0])} monitor steps")
        else:
            lines.append(f"  {arm.name}: {len(onsets)} onset(s); first at step {onsets[0].step}: {onsets[0].describe()}")
        for entry in switches(arm.path):
            change = entry["changes"]["attention.fix"]
            lines.append(f"  {arm.name}: attention.fix switched {change['from']} -> {change['to']} after step "
                         f"{entry['step']} (monitor.on_warning=switch_fix, changes.yaml)")
    return "\n".join(lines)


def _spans(steps: np.ndarray, flags: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) logged step of each run of flags == 1."""
    spans, start = [], None
    for s, f in zip(steps, flags):
        if f >= 0.5 and start is None:
            start = s
        if f < 0.5 and start is not None:
            spans.append((start, prev))
            start = None
        prev = s
    if start is not None:
        spans.append((start, prev))
    return spans


def panel(arms, out_dir: Path) -> tuple[str, str]:
    """``warning_timeline.png``: per arm, the train loss with the span where warning/on was up shaded and each onset
    marked and labelled with the signal that fired; returns (file name, caption)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(arms), 1, figsize=(12, 2.6 * len(arms)), sharex=True, squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        loss = arm.get(tags.TRAIN_LOSS)
        if loss is not None:
            ax.plot(loss[0], loss[1], lw=1.0, color="tab:blue")
        flag = arm.get(tags.WARNING)
        for first, last in (_spans(*flag) if flag is not None else []):
            ax.axvspan(first, last, color="tab:red", alpha=0.15, lw=0)
        for onset in arm_onsets(arm) or []:
            ax.axvline(onset.step, color="tab:red", lw=1.0)
            what = ", ".join(f"{r.signal} {r.where()}" for r in onset.fired)
            ax.annotate(f"{what}\n{onset.numerics.verdict()}", (onset.step, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -3), textcoords="offset points", va="top", fontsize=7, color="tab:red")
        for entry in switches(arm.path):
            ax.axvline(entry["step"], color="tab:green", ls="--", lw=1.2)
            ax.annotate(f"fix -> {entry['changes']['attention.fix']['to']}", (entry["step"], 0.0),
                        xycoords=("data", "axes fraction"), xytext=(3, 3), textcoords="offset points", fontsize=7,
                        color="tab:green")
        state = ("rule not evaluated" if flag is None or arm_onsets(arm) is None else
                 f"{len(_spans(*flag))} warning span(s)")
        first_step = too_short(arm)
        if first_step is not None:
            state += f"; the rule starts at step {first_step}, after this run"
        ax.set_title(f"{arm.name}: train loss, early warning shaded ({state})", fontsize=9)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / PANEL, dpi=90)
    plt.close(fig)
    return PANEL, ("Early warning per arm beside its loss: shaded where warning/on was 1 during training, a line at "
                   "each onset with the signal(s) that fired (layer, head) and whether the numerics signals (tie rate, "
                   "delta bias) agreed; dashed green: attention.fix switched by monitor.on_warning=switch_fix. A warning in the arm with a fix or in both arms alike points away from "
                   "attention rounding.")
