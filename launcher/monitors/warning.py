"""Early warning of the paper's failure from monitors a run already logs: signals, one threshold each, patience.

A **signal** turns one monitor step's logged values of layer ``warning_layer`` (and its history) into a number; its
**condition** holds when that number is above the signal's threshold (``monitor.warning_<signal>``, 0: off). The
warning turns on once some condition has held on ``warning_patience`` consecutive monitor steps that measured it,
from step ``warning_after_step`` on, and is off again when no condition holds (a level, not a latch; readers take
its onsets). The signals (:data:`SIGNALS`):

- ``tie_rate``: the layer's tie rate (``attn/Lxx/tie_rate``, mean over heads); the paper's own leading signal
  (repeated row maxima); near 0 for numerics with FP32 scores (fa2), whatever happens.
- ``wq_growth``: the layer's largest per-head W_Q spectral norm over its value ``warning_window`` steps earlier.
- ``wq_relative``: the layer's whole-W_Q spectral-norm growth over ``warning_window`` steps divided by the median
  growth of the other layers' W_Q over the same steps: early training grows every layer, the failure one.
- ``dwq_cos``: the cosine between successive probe calls' W_Q-gradient errors (``delta_bias/Lxx/dwq_cos``): near 1
  when the delta errors point the same way and add up.
- ``delta_persistence``: |sum| / sum |.| of the layer's last ``warning_baseline`` delta-bias sums
  (``delta_bias/Lxx/sum``): 1 when every call's error has the same sign, ~1/sqrt(n) for random signs.
- ``qk_update_drop``, ``qk_update2_drop``, ``qk_srank_drop``: the largest drop over heads, as a fraction, of the
  spectral entropy of the first-order Q-K update term (entropy), of the second-order term (entropy2) and of the
  first-order term's stable rank (srank) below their own mean over the previous ``warning_baseline`` measurements
  (``qk_update/Lxx/hyy/...``, qk_update.py); Huang et al. (arXiv 2606.28116) report the first-order entropy
  turning abnormal long before divergence.
- ``qk_act_drop``: the same one-sided drop for the spectral entropy of pre-softmax scores of sub-sampled probe
  tokens (``qk_act/Lxx/hyy/entropy``), the activation variant.

Every signal's value is computed whenever its inputs were logged (thresholds only decide what counts), so the values
are logged as ``warning/<signal>`` and a replay of the logged series (:func:`replay`) gives the same numbers as the
live rule; the margin report and the calibration (analysis/warning_calibration.py) replay the logged series with
other thresholds. At an onset the rule says which conditions fired, on which head, and whether the numerics signals
(tie rate against its own recent level, the delta bias's sign) agree, so that a numerics alarm can be told from a
learning-rate one (:class:`Onset`).

The same class serves the live monitor (``Monitors.after_step`` feeds it each step's values) and the offline replay.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional

from launcher.warning_signals import WARNING_SIGNALS
from launcher.monitors import tags

# signal -> (what it measures, for messages); the threshold field is monitor.warning_<signal>
SIGNALS = WARNING_SIGNALS  # names and meanings (launcher/warning_signals.py)
# drop signals: the logged per-head statistic each one follows
DROP_SOURCES = {
    "qk_update_drop": (tags.qk_update, "entropy", "first-order Q-K update spectral entropy"),
    "qk_update2_drop": (tags.qk_update, "entropy2", "second-order Q-K update spectral entropy"),
    "qk_srank_drop": (tags.qk_update, "srank", "first-order Q-K update stable rank"),
    "qk_act_drop": (tags.qk_act, "entropy", "pre-softmax score spectral entropy"),
}
# signals whose value is logged as warning/<signal> (the others are logged tags already)
DERIVED = ("wq_growth", "wq_relative", "delta_persistence", *DROP_SOURCES)
# when an onset's numerics context counts as agreeing (explanation only; not calibrated)
TIE_ELEVATED = 2.0  # tie rate at least this many times its mean over the previous warning_baseline probe calls
ONE_SIGNED = 0.8  # delta_persistence at least this


@dataclass
class WarningRule:
    """Thresholds of the rule (the module docstring), one per signal (0: off); built from a MonitorConfig with
    :meth:`from_monitor`."""

    layer: int = 1
    tie_rate: float = 0.10
    wq_growth: float = 2.0
    window: int = 500
    after_step: int = 200
    patience: int = 2
    wq_relative: float = 0.0
    dwq_cos: float = 0.0
    delta_persistence: float = 0.0
    qk_update_drop: float = 0.0
    qk_update2_drop: float = 0.0
    qk_srank_drop: float = 0.0
    qk_act_drop: float = 0.0
    baseline: int = 8

    @classmethod
    def from_monitor(cls, mon) -> "WarningRule":
        return cls(layer=mon.warning_layer, window=mon.warning_window, after_step=mon.warning_after_step,
                   patience=mon.warning_patience, baseline=mon.warning_baseline,
                   **{s: getattr(mon, f"warning_{s}") for s in SIGNALS})

    def thresholds(self) -> dict[str, float]:
        """The enabled signals and their thresholds."""
        return {s: getattr(self, s) for s in SIGNALS if getattr(self, s) > 0}

    @property
    def enabled(self) -> bool:
        return bool(self.thresholds())

    def describe(self) -> str:
        on = self.thresholds()
        if not on:
            return "early warning disabled (every monitor.warning_<signal> threshold is 0)"
        return (" or ".join(f"{tags.layer_key(self.layer)} {s} > {t:g}" for s, t in on.items())
                + f", on {self.patience} consecutive monitor steps, from step {self.after_step}")


@dataclass(frozen=True)
class Reading:
    """One signal's value at one monitor step; ``head``: the head it comes from (None: the whole layer)."""

    signal: str
    step: int
    value: float
    layer: int
    head: Optional[int] = None
    detail: str = ""

    def where(self) -> str:
        return tags.layer_key(self.layer) + ("" if self.head is None else f" {tags.head_key(self.head)}")


@dataclass
class Numerics:
    """The numerics signals at an onset: do the tie rate and the delta bias say 'attention rounding'?"""

    tie_rate: Optional[float] = None
    tie_baseline: Optional[float] = None
    persistence: Optional[float] = None
    dwq_cos: Optional[float] = None

    @property
    def tie_elevated(self) -> Optional[bool]:
        if self.tie_rate is None or not self.tie_baseline:
            return None
        return not self.tie_rate < TIE_ELEVATED * self.tie_baseline

    @property
    def one_signed(self) -> Optional[bool]:
        return None if self.persistence is None else not self.persistence < ONE_SIGNED

    def verdict(self) -> str:
        votes = [v for v in (self.tie_elevated, self.one_signed) if v is not None]
        if not votes:
            return "numerics signals not measured (tie rate, delta bias off for this layer)"
        if all(votes):
            return "numerics signals agree (the attention-rounding signature)"
        if any(votes):
            return "numerics signals partly agree"
        # not "look elsewhere": 8 of the 9 rounding-driven divergences of the 2026-12-03 H200 grids were warned with
        # both of these quiet (docs/monitoring.md), so quiet signals do not rule attention rounding out
        return ("numerics signals quiet (tie rate not raised, delta bias not one-signed); rounding failures on the "
                "H200 grids warned so too, so this does not rule out attention rounding")

    def describe(self) -> str:
        parts = []
        if self.tie_rate is not None:
            base = f" (x{self.tie_rate / self.tie_baseline:.2g} its recent mean)" if self.tie_baseline else ""
            parts.append(f"tie rate {self.tie_rate:.3g}{base}")
        if self.persistence is not None:
            parts.append(f"delta-bias sums one-signed {self.persistence:.2f}")
        if self.dwq_cos is not None:
            parts.append(f"dwq_cos {self.dwq_cos:.2f}")
        return "; ".join(parts + [self.verdict()])


@dataclass
class Onset:
    """An onset of the warning: the conditions that held for ``patience`` steps, and the numerics context."""

    step: int
    fired: list[Reading]
    thresholds: dict[str, float]
    numerics: Numerics

    def describe(self) -> str:
        said = "; ".join(f"{r.signal} {r.value:.3g} > {self.thresholds[r.signal]:g} on {r.where()}"
                         + (f" ({r.detail})" if r.detail else "") for r in self.fired)
        return f"{said} | {self.numerics.describe()}"

    def to_dict(self) -> dict:
        return {"step": self.step, "numerics": self.numerics.verdict(),
                "fired": [{"signal": r.signal, "value": r.value, "threshold": self.thresholds[r.signal],
                           "layer": r.layer, "head": r.head, "detail": r.detail} for r in self.fired]}


def _per_head(values: dict[str, float], tag_of: Callable[[int], str]) -> dict[int, float]:
    out, h = {}, 0
    while tag_of(h) in values:
        out[h] = values[tag_of(h)]
        h += 1
    return out


def _argmax(per_head: dict[int, float]) -> Optional[int]:
    finite = {h: v for h, v in per_head.items() if math.isfinite(v)}
    return max(finite, key=finite.get) if finite else None


@dataclass
class EarlyWarning:
    """Incremental state of the rule for one run; ``update`` once per monitor step, in step order."""

    rule: WarningRule
    wq_history: list = field(default_factory=list)  # [(step, max W_Q head norm)], pruned to the window
    layer_history: list = field(default_factory=list)  # [(step, {layer: whole W_Q norm})], pruned to the window
    tie_history: list = field(default_factory=list)  # the layer's last `baseline` + 1 tie rates
    delta_sums: list = field(default_factory=list)  # the layer's last `baseline` delta-bias sums
    drop_history: dict = field(default_factory=dict)  # {drop signal: {head: last `baseline` values}}
    last_dwq_cos: Optional[float] = None
    runs: dict = field(default_factory=dict)  # {signal: consecutive monitor steps its condition held}
    on: bool = False
    onset: Optional[Onset] = None  # the latest onset (not saved: said when it happens)

    def update(self, step: int, values: dict[str, float]) -> dict[str, float]:
        """Feed one monitor step's values ({tag: value}); returns the warning tags to log: warning/<signal> for the
        derived signals computed at this step, and warning/on when an enabled signal was measured (none of them if
        nothing relevant was logged at this step). A new onset is left in :attr:`onset` (and said by the caller)."""
        rule = self.rule
        if not rule.enabled:
            return {}
        readings, measured = self.readings(step, values)
        out = {tags.warning_signal(r.signal): r.value for r in readings.values() if r.signal in DERIVED}
        thresholds = rule.thresholds()
        active = step >= rule.after_step
        for signal, threshold in thresholds.items():
            if signal not in measured:
                continue
            r = readings.get(signal)
            above = r is not None and not (r.value <= threshold)  # a non-finite value counts as above
            self.runs[signal] = self.runs.get(signal, 0) + 1 if (above and active) else 0
        if not measured & set(thresholds):
            return out
        was_on = self.on
        held = [s for s in thresholds if self.runs.get(s, 0) >= rule.patience]
        self.on = bool(held)
        if self.on and not was_on:
            self.onset = Onset(step, [readings[s] for s in held if s in readings], thresholds, self._numerics())
        out[tags.WARNING] = 1.0 if self.on else 0.0
        return out

    # ------------------------------------------------------------------------------------------------------------
    # Signals

    def readings(self, step: int, values: dict[str, float]) -> tuple[dict[str, Reading], set[str]]:
        """Every signal computable at this step ({signal: Reading}) and the signals whose inputs were logged at
        this step (measured, even without enough history for a value yet). Updates the histories."""
        rule, layer = self.rule, self.rule.layer
        readings: dict[str, Reading] = {}
        measured: set[str] = set()

        def add(signal: str, value: float, head: Optional[int] = None, detail: str = "") -> None:
            readings[signal] = Reading(signal, step, value, layer, head, detail)

        tie = values.get(tags.attn(layer, "tie_rate"))
        if tie is not None:
            measured.add("tie_rate")
            heads = _per_head(values, lambda h: tags.attn(layer, "tie_rate", h))
            top = _argmax(heads)
            add("tie_rate", tie if math.isfinite(tie) else math.inf, top,
                f"head {tags.head_key(top)} {heads[top]:.3g}" if top is not None and len(heads) > 1 else "")
            if math.isfinite(tie):
                self.tie_history = (self.tie_history + [tie])[-(rule.baseline + 1):]  # now and its baseline
        wq_heads = _per_head(values, lambda h: tags.spectral(layer, "wq", h))
        if wq_heads:
            measured.add("wq_growth")
            finite = all(math.isfinite(v) for v in wq_heads.values())
            current, top = (max(wq_heads.values()), _argmax(wq_heads)) if finite else (math.inf, None)
            earlier = self._at_or_before(self.wq_history, step - rule.window)
            if earlier is not None and earlier[1] > 0:
                add("wq_growth", current / earlier[1], top,
                    f"max W_Q head norm {current:.3g} vs {earlier[1]:.3g} at step {earlier[0]}")
            self.wq_history.append((step, current))
            self.wq_history = self._pruned(self.wq_history, step)
        whole = {i: values[tags.spectral(i, "wq")] for i in range(_layer_count(values))
                 if tags.spectral(i, "wq") in values}
        if layer in whole and len(whole) > 1:
            measured.add("wq_relative")
            earlier = self._at_or_before(self.layer_history, step - rule.window)
            if earlier is not None:
                growth = {i: whole[i] / earlier[1][i] for i in whole if earlier[1].get(i, 0) > 0}
                others = [g for i, g in growth.items() if i != layer]
                if layer in growth and others and statistics.median(others) > 0:
                    rel = growth[layer] / statistics.median(others)
                    add("wq_relative", rel if math.isfinite(rel) else math.inf, None,
                        f"x{growth[layer]:.3g} since step {earlier[0]} vs median x{statistics.median(others):.3g} "
                        "of the other layers")
            self.layer_history.append((step, whole))
            self.layer_history = self._pruned(self.layer_history, step)
        cos = values.get(tags.delta_bias(layer, "dwq_cos"))
        if cos is not None:
            measured.add("dwq_cos")
            heads = _per_head(values, lambda h: tags.delta_bias(layer, "dwq_cos", h))
            add("dwq_cos", cos if math.isfinite(cos) else math.inf, _argmax(heads))
            self.last_dwq_cos = cos
        total = values.get(tags.delta_bias(layer, "sum"))
        if total is not None:
            measured.add("delta_persistence")
            if math.isfinite(total):
                self.delta_sums = (self.delta_sums + [total])[-rule.baseline:]
            if len(self.delta_sums) == rule.baseline:
                magnitude = sum(abs(x) for x in self.delta_sums)
                if magnitude > 0:
                    add("delta_persistence", abs(sum(self.delta_sums)) / magnitude, None,
                        f"over {rule.baseline} probe calls, sum {sum(self.delta_sums):+.3g}")
        for signal, (tag_of, stat, what) in DROP_SOURCES.items():
            heads = _per_head(values, lambda h: tag_of(layer, stat, h))
            if not heads:
                continue
            measured.add(signal)
            history = self.drop_history.setdefault(signal, {})
            drops = {}
            for h, x in heads.items():
                if not math.isfinite(x):
                    continue  # no update (zero) or no spectrum: not measured for this head
                past = history.get(h, [])
                mean = sum(past) / len(past) if past else 0.0
                if len(past) == rule.baseline and mean > 0:
                    drops[h] = (1.0 - x / mean, x, mean)
                history[h] = (past + [x])[-rule.baseline:]
            if drops:
                top = max(drops, key=lambda h: drops[h][0])
                drop, x, mean = drops[top]
                add(signal, drop, top, f"{what} {x:.3g} vs its mean {mean:.3g} over {rule.baseline} points")
        return readings, measured

    def _numerics(self) -> Numerics:
        past = self.tie_history[:-1] if len(self.tie_history) > 1 else []
        persistence = None
        if len(self.delta_sums) == self.rule.baseline:
            magnitude = sum(abs(x) for x in self.delta_sums)
            persistence = abs(sum(self.delta_sums)) / magnitude if magnitude > 0 else None
        return Numerics(self.tie_history[-1] if self.tie_history else None,
                        sum(past) / len(past) if past else None, persistence, self.last_dwq_cos)

    @staticmethod
    def _at_or_before(history: list, step: int):
        earlier = [p for p in history if p[0] <= step]
        return earlier[-1] if earlier else None

    def _pruned(self, history: list, step: int) -> list:
        # keep the newest point at or before (step - window) and everything after it: enough for later steps
        older = [i for i, p in enumerate(history) if p[0] <= step - self.rule.window]
        return history[older[-1]:] if len(older) > 1 else history

    # ------------------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"version": 2, "wq_history": [list(p) for p in self.wq_history],
                "layer_history": [[s, {str(i): v for i, v in w.items()}] for s, w in self.layer_history],
                "tie_history": list(self.tie_history), "delta_sums": list(self.delta_sums),
                "drop_history": {s: {str(h): list(v) for h, v in d.items()} for s, d in self.drop_history.items()},
                "last_dwq_cos": self.last_dwq_cos, "runs": dict(self.runs), "on": self.on}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 2:  # written before the signals framework: tie rate and W_Q growth only
            self.wq_history = [(int(s), float(v)) for s, v in state.get("history", [])]
            self.runs = {"tie_rate": int(state.get("tie_run", 0)), "wq_growth": int(state.get("wq_run", 0))}
            self.on = bool(state.get("on", False))
            return
        self.wq_history = [(int(s), float(v)) for s, v in state["wq_history"]]
        self.layer_history = [(int(s), {int(i): float(v) for i, v in w.items()}) for s, w in state["layer_history"]]
        self.tie_history = [float(v) for v in state["tie_history"]]
        self.delta_sums = [float(v) for v in state["delta_sums"]]
        self.drop_history = {s: {int(h): [float(x) for x in v] for h, v in d.items()}
                             for s, d in state["drop_history"].items()}
        self.last_dwq_cos = state["last_dwq_cos"]
        self.runs = {s: int(n) for s, n in state["runs"].items()}
        self.on = bool(state["on"])


def _layer_count(values: dict[str, float]) -> int:
    layers = [t.layer for t in map(tags.parse, values) if t is not None]
    return max(layers) + 1 if layers else 0


# ----------------------------------------------------------------------------------------------------------------
# Offline: the rule over logged series


@dataclass
class Replay:
    """The rule over a run's logged series: the first onset, the flag at every monitor step that measured an enabled
    signal, every onset, every signal's readings (whatever the thresholds) and the steps that measured it."""

    first: Optional[int]
    flags: list[tuple[int, float]]
    onsets: list[Onset]
    readings: dict[str, list[Reading]]
    measured: dict[str, list[int]]


def _by_step(scalars: dict) -> dict[int, dict[str, float]]:
    wanted = {t: s for t, s in scalars.items() if tags.parse(t) is not None}
    by_step: dict[int, dict[str, float]] = {}
    for tag, (steps, values) in wanted.items():
        for s, v in zip(steps, values):
            by_step.setdefault(int(s), {})[tag] = float(v)
    return by_step


def replay(rule: WarningRule, scalars: dict) -> Replay:
    """Feed a run's logged series ({tag: (steps, values)}, as launcher.compare.load_scalars gives) through the rule,
    step by step, as the live monitor did."""
    state = EarlyWarning(rule)
    flags, onsets, first = [], [], None
    readings: dict[str, list[Reading]] = {s: [] for s in SIGNALS}
    measured: dict[str, list[int]] = {s: [] for s in SIGNALS}
    always = EarlyWarning(rule)  # readings only, with histories of their own: thresholds never change them
    for step, values in sorted(_by_step(scalars).items()):
        now, present = always.readings(step, values)
        for r in now.values():
            readings[r.signal].append(r)
        for signal in present:
            measured[signal].append(step)
        out = state.update(step, values)
        if tags.WARNING in out:
            flags.append((step, out[tags.WARNING]))
            if out[tags.WARNING] and (not onsets or onsets[-1] is not state.onset):
                onsets.append(state.onset)
                first = first if first is not None else step
    return Replay(first, flags, onsets, readings, measured)


def evaluate(rule: WarningRule, scalars: dict) -> tuple[Optional[int], list[tuple[int, float]]]:
    """(first step the warning is on, or None; [(step, flag)] at every monitor step), from logged series."""
    result = replay(rule, scalars)
    return result.first, result.flags


def first_onset(readings: list[Reading], threshold: float, patience: int, after_step: int,
                measured_steps: Optional[list[int]] = None) -> Optional[int]:
    """The first step at which one signal's condition (value above ``threshold``) has held on ``patience``
    consecutive measured steps from ``after_step`` on: what the live rule gives with only this signal enabled.
    ``measured_steps``: the steps its inputs were logged (default: the readings' steps); a measured step without a
    reading (not enough history yet) breaks a run, as it does live."""
    by_step = {r.step: r.value for r in readings}
    run = 0
    for step in (measured_steps if measured_steps is not None else sorted(by_step)):
        value = by_step.get(step)
        above = value is not None and not (value <= threshold)
        run = run + 1 if (above and step >= after_step) else 0
        if run >= patience:
            return step
    return None
