"""Early warning of the paper's failure from monitors a normal run already logs (issue 19, deliverable 6).

The rule (thresholds are ``monitor.warning_*`` fields, see launcher/config.py; defaults calibrated on one GPU
margin grid, docs/results.md): from step ``warning_after_step`` on, a condition holds at a monitor step when

- ``tie``: layer ``warning_layer``'s tie rate (``attn/Lxx/tie_rate``, mean over heads) is above ``warning_tie_rate``, or
- ``wq``: that layer's largest per-head W_Q spectral norm (max over ``spectral/Lxx/wq/hyy``) is more than
  ``warning_wq_growth`` times its value ``warning_window`` steps earlier (the latest logged point at or before
  step - window);

and the warning is on once a condition has held on ``warning_patience`` consecutive monitor steps that measured it.
It is off again when neither holds (it is a level, not a latch; readers take its first onset).

The defaults come from the accelerated runs of docs/paper-notes.md (6 x 384 GPT, H200): on diverging arms layer 1's
tie rate climbed from ~1% to 25-44% and its largest W_Q head norm went 6 -> 30 -> 70 before the loss exploded, while
stable random-sign arms stayed at tie rates of 1-2% and W_Q ~15.

The same class serves the live monitor (``Monitors.after_step`` feeds it each step's values) and the margin report
(``evaluate`` replays logged series), so both apply one rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from launcher.monitors import tags


@dataclass
class WarningRule:
    """Thresholds of the rule (the module docstring); built from a MonitorConfig with :meth:`from_monitor`."""

    layer: int = 1
    tie_rate: float = 0.10
    wq_growth: float = 2.0
    window: int = 500
    after_step: int = 200
    patience: int = 2

    @classmethod
    def from_monitor(cls, mon) -> "WarningRule":
        return cls(mon.warning_layer, mon.warning_tie_rate, mon.warning_wq_growth, mon.warning_window,
                   mon.warning_after_step, mon.warning_patience)

    @property
    def enabled(self) -> bool:
        return self.tie_rate > 0 or self.wq_growth > 0

    def describe(self) -> str:
        parts = []
        if self.tie_rate > 0:
            parts.append(f"{tags.layer_key(self.layer)} tie rate > {self.tie_rate:g}")
        if self.wq_growth > 0:
            parts.append(f"{tags.layer_key(self.layer)} max W_Q head norm x{self.wq_growth:g} within "
                         f"{self.window} steps")
        if not parts:
            return "early warning disabled (monitor.warning_tie_rate = monitor.warning_wq_growth = 0)"
        return (" or ".join(parts) + f", on {self.patience} consecutive monitor steps, from step {self.after_step}")


@dataclass
class EarlyWarning:
    """Incremental state of the rule for one run; ``update`` once per monitor step, in step order."""

    rule: WarningRule
    history: list = field(default_factory=list)  # [(step, max W_Q head norm)], pruned to the window
    tie_run: int = 0
    wq_run: int = 0
    on: bool = False

    def update(self, step: int, values: dict[str, float]) -> dict[str, float]:
        """Feed one monitor step's values ({tag: value}); returns the warning tags to log (none if nothing
        relevant was measured at this step)."""
        rule = self.rule
        if not rule.enabled:
            return {}
        out: dict[str, float] = {}
        active = step >= rule.after_step
        tie = values.get(tags.attn(rule.layer, "tie_rate"))
        heads = [v for t, v in values.items() if _is_wq_head(t, rule.layer)]
        measured = False
        if tie is not None and rule.tie_rate > 0:
            measured = True
            # a non-finite tie rate means the scores are broken already: that counts as above
            above = not (tie <= rule.tie_rate)
            self.tie_run = self.tie_run + 1 if (above and active) else 0
        if heads and rule.wq_growth > 0:
            measured = True
            current = max(heads) if all(math.isfinite(h) for h in heads) else math.inf
            ratio = self._growth(step, current)
            if ratio is not None:
                out[tags.WARNING_WQ_GROWTH] = ratio
                above = not (ratio <= rule.wq_growth)
                self.wq_run = self.wq_run + 1 if (above and active) else 0
            self.history.append((step, current))
            self._prune(step)
        if not measured:
            return {}
        self.on = self.tie_run >= rule.patience or self.wq_run >= rule.patience
        out[tags.WARNING] = 1.0 if self.on else 0.0
        return out

    def _growth(self, step: int, current: float) -> Optional[float]:
        earlier = [v for s, v in self.history if s <= step - self.rule.window]
        if not earlier or not earlier[-1] > 0:
            return None
        return current / earlier[-1]

    def _prune(self, step: int) -> None:
        # keep the newest point at or before (step - window) and everything after it: enough for later steps
        cut = step - self.rule.window
        older = [i for i, (s, _) in enumerate(self.history) if s <= cut]
        if len(older) > 1:
            del self.history[:older[-1]]

    def state_dict(self) -> dict:
        return {"history": [list(p) for p in self.history], "tie_run": self.tie_run, "wq_run": self.wq_run,
                "on": self.on}

    def load_state_dict(self, state: dict) -> None:
        self.history = [(int(s), float(v)) for s, v in state.get("history", [])]
        self.tie_run, self.wq_run = int(state.get("tie_run", 0)), int(state.get("wq_run", 0))
        self.on = bool(state.get("on", False))


def _is_wq_head(tag: str, layer: int) -> bool:
    t = tags.parse(tag)
    return t is not None and t.family == "spectral" and t.stat == "wq" and t.layer == layer and t.head is not None


def evaluate(rule: WarningRule, scalars: dict) -> tuple[Optional[int], list[tuple[int, float]]]:
    """Replay the rule over a run's logged series ({tag: (steps, values)}, as launcher.compare.load_scalars gives).
    Returns (first step the warning is on, or None; [(step, flag)] at every monitor step)."""
    wanted = {t: s for t, s in scalars.items()
              if t == tags.attn(rule.layer, "tie_rate") or _is_wq_head(t, rule.layer)}
    by_step: dict[int, dict[str, float]] = {}
    for tag, (steps, values) in wanted.items():
        for s, v in zip(steps, values):
            by_step.setdefault(int(s), {})[tag] = float(v)
    state = EarlyWarning(rule)
    flags, first = [], None
    for step in sorted(by_step):
        out = state.update(step, by_step[step])
        if tags.WARNING in out:
            flags.append((step, out[tags.WARNING]))
            if out[tags.WARNING] and first is None:
                first = step
    return first, flags
