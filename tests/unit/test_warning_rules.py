"""Every signal of the early-warning rule (launcher/monitors/warning.py) on synthetic logged series: it fires on
the failure's shape and names where, stays quiet otherwise, waits for its patience, resumes its state exactly, and
the offline onset of one signal (what the calibration sweeps) is the live rule's."""

import json
import math
import random

import numpy as np
import pytest

from launcher.monitors import tags
from launcher.monitors.warning import SIGNALS, EarlyWarning, WarningRule, first_onset, replay

STEPS = list(range(0, 2001, 25))
START = 1000  # where the abnormal series turn


def _noise(step: int, scale: float) -> float:
    return scale * math.sin(0.7 * step + 1.3)  # deterministic, zero-mean-ish wiggle


def series(signal: str, abnormal: bool, spike_at: int | None = None) -> dict:
    """{tag: (steps, values)} that the signal reads; ``abnormal``: the failure's shape from START on; ``spike_at``:
    one monitor step with the abnormal value in an otherwise quiet series."""

    def bad(s):
        return (abnormal and s >= START) or s == spike_at

    out = {}

    def put(tag, fn):
        out[tag] = (np.array(STEPS), np.array([fn(s) for s in STEPS], dtype=float))

    if signal == "tie_rate":
        put(tags.attn(1, "tie_rate"), lambda s: 0.3 if bad(s) else 0.01)
        for h in range(2):
            put(tags.attn(1, "tie_rate", h), lambda s, h=h: (0.5 if bad(s) and h == 1 else 0.02) + 0.0)
    elif signal == "wq_growth":
        for h in range(2):
            put(tags.spectral(1, "wq", h), lambda s, h=h: 5.0 * (math.exp((s - START) / 100) if h == 1 and bad(s)
                                                                 else 1.0) + 0.001 * s)
    elif signal == "wq_relative":
        for i in range(4):  # every layer grows alike early, layer 1 alone later
            put(tags.spectral(i, "wq"), lambda s, i=i: (6 + 0.004 * s) * (math.exp((s - START) / 100)
                                                                           if i == 1 and bad(s) else 1.0))
    elif signal == "dwq_cos":
        put(tags.delta_bias(1, "dwq_cos"), lambda s: 0.95 if bad(s) else _noise(s, 0.3))
    elif signal == "delta_persistence":
        put(tags.delta_bias(1, "sum"), lambda s: 0.02 if bad(s) else (0.02 if (s // 25) % 2 else -0.02) + _noise(s, 0.001))
    else:
        family, stat, level = {"qk_update_drop": (tags.qk_update, "entropy", 0.8),
                               "qk_update2_drop": (tags.qk_update, "entropy2", 0.7),
                               "qk_srank_drop": (tags.qk_update, "srank", 5.0),
                               "qk_act_drop": (tags.qk_act, "entropy", 0.6)}[signal]
        for h in range(3):
            put(family(1, stat, h), lambda s, h=h: level * (0.3 if bad(s) and h == 2 else 1.0 + _noise(s + h, 0.01)))
    return out


THRESHOLDS = {"tie_rate": 0.1, "wq_growth": 2.0, "wq_relative": 2.0, "dwq_cos": 0.8, "delta_persistence": 0.8,
              "qk_update_drop": 0.3, "qk_update2_drop": 0.3, "qk_srank_drop": 0.3, "qk_act_drop": 0.3}
HEAD = {"tie_rate": 1, "wq_growth": 1, "qk_update_drop": 2, "qk_update2_drop": 2, "qk_srank_drop": 2,
        "qk_act_drop": 2}  # the head each crafted failure sits in
ONE_POINT = ("tie_rate", "dwq_cos", "qk_update_drop", "qk_update2_drop", "qk_srank_drop", "qk_act_drop")


def only(signal: str, patience: int = 2) -> WarningRule:
    return WarningRule(**{**dict(tie_rate=0.0, wq_growth=0.0), signal: THRESHOLDS[signal]}, window=200,
                       after_step=100, patience=patience, baseline=8)


def test_every_signal_is_tested():
    assert set(THRESHOLDS) == set(SIGNALS)


@pytest.mark.parametrize("signal", list(SIGNALS))
def test_fires_on_the_failure_and_names_it(signal):
    result = replay(only(signal), series(signal, abnormal=True))
    assert result.first is not None and START <= result.first <= START + 8 * 25, result.first
    onset = result.onsets[0]
    assert [r.signal for r in onset.fired] == [signal] and onset.fired[0].layer == 1
    assert onset.fired[0].head == HEAD.get(signal)
    text = onset.describe()
    assert f"{signal} " in text and "L01" in text and "numerics" in text
    assert dict(result.flags)[result.first] == 1.0
    # a level stays on while it lasts; a drop is measured against a rolling baseline, which follows the new level
    assert dict(result.flags)[STEPS[-1]] == (0.0 if signal.endswith("_drop") else 1.0)


@pytest.mark.parametrize("signal", list(SIGNALS))
def test_quiet_series_do_not_fire(signal):
    result = replay(only(signal), series(signal, abnormal=False))
    assert result.first is None and result.flags and not any(f for _, f in result.flags)
    assert result.readings[signal]  # measured throughout, just never above


@pytest.mark.parametrize("signal", ONE_POINT)
def test_one_point_does_not_fire_before_its_patience(signal):
    spike = series(signal, abnormal=False, spike_at=1500)
    assert replay(only(signal, patience=2), spike).first is None
    assert replay(only(signal, patience=1), spike).first == 1500


@pytest.mark.parametrize("signal", list(SIGNALS))
def test_state_resumes_exactly(signal):
    rule = only(signal)
    by_step = {}
    for tag, (steps, values) in series(signal, abnormal=True).items():
        for s, v in zip(steps, values):
            by_step.setdefault(int(s), {})[tag] = float(v)
    feed = sorted(by_step.items())
    whole = EarlyWarning(rule)
    a = [whole.update(s, v) for s, v in feed]
    first = EarlyWarning(rule)
    cut = len(feed) * 9 // 20  # mid-baseline, before the onset
    b = [first.update(s, v) for s, v in feed[:cut]]
    resumed = EarlyWarning(rule)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # plain values only
    b += [resumed.update(s, v) for s, v in feed[cut:]]
    assert a == b and any(x.get(tags.WARNING) for x in a)


@pytest.mark.parametrize("signal", list(SIGNALS))
def test_offline_onset_of_one_signal_is_the_live_rules(signal):
    """first_onset on the replayed readings (what the calibration sweeps) = the live rule's first onset."""
    rng = random.Random(signal)
    for abnormal in (True, False):
        data = series(signal, abnormal)
        result = replay(only(signal), data)
        for patience in (1, 2, 3):
            rule = only(signal, patience)
            for threshold in (THRESHOLDS[signal], THRESHOLDS[signal] * rng.uniform(0.3, 3)):
                rule = WarningRule(**{**rule.__dict__, signal: threshold})
                live = replay(rule, data).first
                assert first_onset(result.readings[signal], threshold, patience, rule.after_step,
                                   result.measured[signal]) == live


def test_numerics_context_of_an_onset():
    """A drop that comes with a climbing tie rate and one-signed delta bias is the attention-rounding signature; the
    same drop with neither is not."""
    rule = only("qk_update_drop")
    drop = series("qk_update_drop", abnormal=True)
    signature = {**drop,
                 tags.attn(1, "tie_rate"): (np.array(STEPS), np.array([0.2 if s >= START else 0.01 for s in STEPS])),
                 tags.delta_bias(1, "sum"): (np.array(STEPS), np.array([0.03] * len(STEPS)))}
    onset = replay(rule, signature).onsets[0]
    assert onset.numerics.tie_elevated and onset.numerics.one_signed
    assert "agree (the attention-rounding signature)" in onset.describe()
    quiet = {**drop, **series("delta_persistence", abnormal=False),
             tags.attn(1, "tie_rate"): (np.array(STEPS), np.array([0.01] * len(STEPS)))}
    onset = replay(rule, quiet).onsets[0]
    assert onset.numerics.tie_elevated is False and onset.numerics.one_signed is False
    assert "numerics signals quiet" in onset.describe() and "does not rule out attention rounding" in onset.describe()
    assert "not measured" in replay(rule, drop).onsets[0].describe()


def test_state_written_before_the_signals_framework_loads():
    state = EarlyWarning(WarningRule())
    state.load_state_dict({"history": [[100, 5.0]], "tie_run": 1, "wq_run": 0, "on": True})
    assert state.wq_history == [(100, 5.0)] and state.runs == {"tie_rate": 1, "wq_growth": 0} and state.on
