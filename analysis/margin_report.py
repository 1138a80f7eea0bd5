"""The margin report of ``python -m analysis.margin``: divergence rule, margins, early-warning evaluation, figures.

Divergence rule (:func:`judge`, applied live by the runner and again here on the TensorBoard events; docs/margin.md).
An arm diverges at the first logged step where

1. its train loss or gradient norm is not finite, or the trainer's guard stopped it (guard/bad_steps); or
2. its train loss is more than ``margin.loss_margin`` nats above the median train loss of the seed's arms at that
   step, on ``margin.patience`` consecutive logged points (the median needs ``margin.min_arms`` arms that logged the
   step; with fewer, the reference is the arm's own lowest loss so far); or
3. its gradient norm is more than ``margin.grad_factor`` x the median gradient norm of the seed's arms at that step,
   on ``margin.patience`` consecutive logged points (only where ``min_arms`` arms logged the step).

An arm survives when it reaches run.max_steps without diverging. Margin of a (numerics, sign, seed): the largest
gain that survived and the smallest that diverged (observed, or implied by the bisection's monotone assumption).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from kernels.modes import REFERENCE_FIX
from launcher.compare import load_scalars, smooth
from launcher.monitors import tags
from launcher.monitors.warning import WarningRule, replay
from analysis.warning_calibration import ARMS_FILE, ArmOutcome, rule_scores, table

STATE_FILE = "margin_state.json"  # the runner's record of judged arms, in the experiment folder


def load_state(path: Path) -> dict:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass
    return {"version": 1, "arms": {}}


def save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(path)


def bisect_path(gains: list[tuple[float, str]], result_of) -> tuple[Optional[int], int, tuple[int, int]]:
    """Walk the bisection over a series' gains. ``result_of(key)`` -> 'survived' | 'diverged' | None (unknown).
    Returns (index of the first gain whose result is unknown, or None when decided; its depth; (lo, hi) bounds:
    gains below lo survive, above hi diverge)."""
    lo, hi, depth = 0, len(gains) - 1, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        result = result_of(gains[mid][1])
        if result not in ("survived", "diverged"):
            return mid, depth, (lo, hi)
        if result == "survived":
            lo = mid + 1
        else:
            hi = mid - 1
        depth += 1
    return None, depth, (lo, hi)

REPORT_DIR = "margin_report"


@dataclass
class DivergenceRule:
    loss_margin: float = 1.0
    grad_factor: float = 10.0
    patience: int = 3
    min_arms: int = 3

    def describe(self) -> str:
        grad = (f", or grad norm > {self.grad_factor:g} x the median" if self.grad_factor else "")
        return (f"non-finite loss/grad norm (or the trainer's guard stopped the arm); or train loss > median of the "
                f"seed's arms at the same step + {self.loss_margin:g} nats{grad}, on {self.patience} consecutive "
                f"logged points (median over >= {self.min_arms} arms, else the arm's own lowest loss so far)")


@dataclass
class Verdict:
    step: int
    reason: str


def judge(curves: dict[str, tuple], rule: DivergenceRule) -> dict[str, Verdict]:
    """{arm: (steps, losses, grad norms)} of one seed's arms -> {arm: Verdict} for the arms that diverged."""
    per_step_loss: dict[int, list[float]] = {}
    per_step_grad: dict[int, list[float]] = {}
    for steps, losses, grads in curves.values():
        for s, l, g in zip(steps, losses, grads):
            per_step_loss.setdefault(int(s), []).append(l)
            if g is not None:
                per_step_grad.setdefault(int(s), []).append(g)

    def median(values: list[float]) -> Optional[float]:
        finite = [v for v in values if math.isfinite(v)]
        return float(np.median(finite)) if len(values) >= rule.min_arms and finite else None

    loss_median = {s: median(v) for s, v in per_step_loss.items()}
    grad_median = {s: median(v) for s, v in per_step_grad.items()}
    out = {}
    for arm, (steps, losses, grads) in curves.items():
        best = math.inf
        loss_run = grad_run = 0
        first_loss = first_grad = None
        for s, l, g in zip(steps, losses, grads):
            s = int(s)
            if g is None:  # not logged at this step: only the loss rules apply
                g = 0.0
            if not math.isfinite(l) or not math.isfinite(g):
                what = "loss" if not math.isfinite(l) else "grad norm"
                out[arm] = Verdict(s, f"non-finite {what} ({l if what == 'loss' else g})")
                break
            ref = loss_median.get(s)
            reference = ref if ref is not None else best
            if math.isfinite(reference) and l > reference + rule.loss_margin:
                first_loss = s if loss_run == 0 else first_loss
                loss_run += 1
                if loss_run >= rule.patience:
                    kind = "median of the arms" if ref is not None else "its own lowest loss so far"
                    out[arm] = Verdict(first_loss, f"loss {l:.3f} > {kind} {reference:.3f} + {rule.loss_margin:g} "
                                                   f"nats for {loss_run} logged points from step {first_loss}")
                    break
            else:
                loss_run = 0
            gref = grad_median.get(s)
            if rule.grad_factor and gref is not None and gref > 0 and g > rule.grad_factor * gref:
                first_grad = s if grad_run == 0 else first_grad
                grad_run += 1
                if grad_run >= rule.patience:
                    out[arm] = Verdict(first_grad, f"grad norm {g:.3g} > {rule.grad_factor:g} x the median "
                                                   f"{gref:.3g} for {grad_run} logged points from step {first_grad}")
                    break
            else:
                grad_run = 0
            best = min(best, l)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Margins


@dataclass
class Outcome:
    """What a grid cell came to: survived / diverged (observed or implied), failed, or not run."""

    status: str  # survived | diverged | failed | killed | running | none
    observed: bool
    step: Optional[int] = None
    arm: Optional[str] = None

    def short(self) -> str:
        if self.status == "diverged":
            text = f"D@{self.step}" if self.observed and self.step is not None else "D"
        elif self.status == "survived":
            text = "S"
        elif self.status == "failed":
            text = "fail"
        elif self.status == "killed":
            text = "killed"
        else:
            return "-"
        return text if self.observed else f"({text})"


def series_outcomes(gains: list[tuple[float, str]], status: dict[str, dict], bisect: bool) -> dict[float, Outcome]:
    """Per gain of a series: observed results, and (bisect) the ones its bisection implies."""

    def result_of(key):
        return status.get(key, {}).get("status")

    out = {}
    for g, key in gains:
        a = status.get(key, {})
        st = a.get("status")
        if st in ("survived", "diverged", "failed", "killed"):
            out[g] = Outcome(st, True, a.get("step"), key)
        else:
            out[g] = Outcome("none", False, arm=key)
    if bisect:
        index, _, (lo, hi) = bisect_path(gains, result_of)
        if index is None:
            for i, (g, key) in enumerate(gains):
                if not out[g].observed:
                    out[g] = Outcome("survived" if i < lo else "diverged", False, arm=key)
    return out


@dataclass
class Margin:
    largest_survived: Optional[float]
    smallest_diverged: Optional[float]
    implied: bool
    monotone: bool

    def text(self) -> str:
        s = "none" if self.largest_survived is None else f"{self.largest_survived:g}"
        d = "none" if self.smallest_diverged is None else f"{self.smallest_diverged:g}"
        flag = "" if self.monotone else " (non-monotone!)"
        return f"survives {s} / diverges {d}{flag}"


def margin_of(outcomes: dict[float, Outcome]) -> Margin:
    survived = [g for g, o in outcomes.items() if o.status == "survived"]
    diverged = [g for g, o in outcomes.items() if o.status == "diverged"]
    obs_s = [g for g, o in outcomes.items() if o.status == "survived" and o.observed]
    obs_d = [g for g, o in outcomes.items() if o.status == "diverged" and o.observed]
    monotone = not (obs_s and obs_d and max(obs_s) > min(obs_d))
    ls = max(survived) if survived else None
    sd = min(diverged) if diverged else None
    implied = any(not outcomes[g].observed for g in (ls, sd) if g is not None)
    return Margin(ls, sd, implied, monotone)


def bias_verdict(kept: Optional[Margin], random: Optional[Margin], kept_out, random_out) -> str:
    """The random-sign control judged against the kept sign (issue 19: the control must survive where kept
    diverges; where it does not, the test measures the error's size, not its bias)."""
    if kept is None or random is None:
        return "no control (margin.signs lacks kept or random)"
    if kept.smallest_diverged is None:
        return "kept sign never diverged within the run's steps: no margin found, the control cannot tell"
    g = kept.smallest_diverged
    r = random_out.get(g)
    if r is None or r.status in ("none", "failed", "killed"):
        return f"kept diverges at g={g:g}; the random control was not run there"
    if r.status == "survived":
        return (f"bias: random sign survives g={g:g} where kept diverges"
                + (" (implied)" if not r.observed else ""))
    return f"size, not bias: random sign diverges at g={g:g} too"


# ----------------------------------------------------------------------------------------------------------------
# The report


def _finalise_status(experiment_dir: Path, plan, state: dict, rule: DivergenceRule, max_steps: int) -> tuple:
    """Read every arm's events; re-judge with all arms present (an arm the live rule stopped stays diverged)."""
    scalars: dict[str, dict] = {}
    for key in plan.arms:
        arm_dir = experiment_dir / key
        scalars[key] = load_scalars(arm_dir) if arm_dir.is_dir() else {}
    status = {k: dict(v) for k, v in state.get("arms", {}).items() if k in plan.arms}
    # a killed or failed arm's curves stop where its process died: they are not judged (the runner says the same)
    ended_early = {k for k, v in status.items() if v.get("status") in ("killed", "failed")}
    for seed in plan.config.seeds:
        curves = {}
        for key, sc in scalars.items():
            if plan.arms[key].seed != seed or tags.TRAIN_LOSS not in sc or key in ended_early:
                continue
            steps, loss = sc[tags.TRAIN_LOSS]
            grad = sc.get(tags.TRAIN_GRAD_NORM)
            grads = dict(zip(grad[0].tolist(), grad[1].tolist())) if grad is not None else {}
            curves[key] = (steps.tolist(), loss.tolist(), [grads.get(s) for s in steps.tolist()])
        verdicts = judge(curves, rule)
        for key, v in verdicts.items():
            entry = status.setdefault(key, {})
            if entry.get("status") != "diverged":
                entry.update(status="diverged", step=v.step, reason=v.reason + " (judged by the report)")
        for key, sc in scalars.items():
            bad = sc.get(tags.GUARD_BAD_STEPS)
            if plan.arms[key].seed == seed and bad is not None and len(bad[0]) and key not in ended_early and \
                    status.get(key, {}).get("status") != "diverged":
                status.setdefault(key, {}).update(status="diverged", step=int(bad[0][0]),
                                                  reason="trainer guard: non-finite loss or gradient")
    return scalars, status


def write_report(experiment_dir: Path, plan, config) -> Path:
    """Write margin_report/{margin.md, margin.html, *.png} from the runs so far; print the table; return the HTML."""

    m = plan.config
    experiment_dir = Path(experiment_dir)
    out = experiment_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    rule = DivergenceRule(m.loss_margin, m.grad_factor, m.patience, m.min_arms)
    max_steps = config.run.max_steps
    scalars, status = _finalise_status(experiment_dir, plan, load_state(experiment_dir / STATE_FILE), rule,
                                       max_steps)
    bisect = m.schedule == "bisect"
    outcomes = {sid: series_outcomes(g, status, bisect) for sid, g in plan.series.items()}
    margins = {sid: margin_of(o) for sid, o in outcomes.items()}
    warn_rule = WarningRule.from_monitor(config.monitor)
    replays = {key: replay(warn_rule, sc) for key, sc in scalars.items() if sc}
    warnings = {key: r.first for key, r in replays.items()}
    arms = arm_outcomes(plan, status, outcomes, margins, max_steps)
    if config.monitor.on_warning == "switch_fix":  # an arm switched at its warning shows nothing the rule predicted
        arms = [a for a in arms if warnings.get(a.key) is None]
    (out / ARMS_FILE).write_text(json.dumps([a.to_dict() for a in arms], indent=1))

    md = [f"# Margin report: {experiment_dir}", "",
          f"{len(plan.arms)} distinct runs for {sum(len(a.cells) for a in plan.arms.values())} grid cells; "
          f"{max_steps} steps per arm; schedule {m.schedule}; " + (
              f"delta error measured from the {m.reference} reference (delta = delta_ref + g * s * (delta_mode - "
              "delta_ref))." if m.stress == "delta" else
              "the gains amplify the output's rounding error (O = LP(O_fp32 + g * s * (O_mode - O_fp32)))."), "",
          f"**Divergence rule**: {rule.describe()}.", "",
          "## Margin per numerics", "",
          "Largest gain that survived / smallest that diverged within the run's steps. `(implied)`: the bisection "
          "did not run that cell; it assumes a larger gain never makes training more stable.", ""]
    header = "| numerics | seed | kept | random | control |"
    md += [header, "|---|---|---|---|---|"]
    for numerics in m.numerics:
        for seed in m.seeds:
            k = margins.get((numerics, "kept", seed))
            r = margins.get((numerics, "random", seed))
            control = bias_verdict(k, r, outcomes.get((numerics, "kept", seed), {}),
                                   outcomes.get((numerics, "random", seed), {}))
            md.append(f"| {numerics} | {seed} | {_mtext(k)} | {_mtext(r)} | {control} |")
    if len(m.seeds) > 1:
        md += ["", "Over seeds: a gain survives if it survived in every seed, diverges if it diverged in any "
               "(how many in parentheses).", "", "| numerics | kept | random | control |", "|---|---|---|---|"]
        for numerics in m.numerics:
            pooled = {sign: pool_seeds([outcomes[(numerics, sign, seed)] for seed in m.seeds
                                        if (numerics, sign, seed) in outcomes]) for sign in m.signs}
            pm = {sign: margin_of(o) for sign, o in pooled.items() if o}
            control = bias_verdict(pm.get("kept"), pm.get("random"), pooled.get("kept", {}),
                                   pooled.get("random", {}))
            md.append(f"| {numerics} | {_pooled_text(pm.get('kept'), pooled.get('kept'))} | "
                      f"{_pooled_text(pm.get('random'), pooled.get('random'))} | {control} |")
    md += ["", "## Every cell", "",
           "S survived, D@step diverged at that step, (..) implied by the bisection, - not run, fail: the arm "
           "crashed (see its log), killed: a signal ended it (likely the out-of-memory killer; --retry-failed "
           "continues it).", ""]
    gains = sorted(m.gains)
    md.append("| numerics | sign | seed | " + " | ".join(f"g={g:g}" for g in gains) + " |")
    md.append("|---|---|---|" + "---|" * len(gains))
    for (numerics, sign, seed), o in outcomes.items():
        md.append(f"| {numerics} | {sign} | {seed} | " + " | ".join(o[g].short() for g in gains) + " |")
    md += ["", "## Arms", "", "| arm | seed | cells | status | step | reason | early warning | lead / false alarm | "
           "which signal, where; numerics |", "|---|---|---|---|---|---|---|---|---|"]
    leads, false_alarms, stable, too_early, switched = [], 0, 0, 0, 0
    switches = config.monitor.on_warning == "switch_fix"
    for key, spec in plan.arms.items():
        st = status.get(key, {})
        s = st.get("status", "not run")
        w = warnings.get(key)
        judged = ""
        if switches and w is not None and s in ("diverged", "survived"):
            # the arm trained on with another fix from its warning on: what it would have done without the switch
            # is not observed, so it is neither a stable arm (no false alarm) nor a warned divergence
            judged = (f"switched to fix={config.monitor.switch_fix_to} at the warning; "
                      + ("survived" if s == "survived" else f"diverged anyway at {st.get('step')}"))
            switched += 1
        elif s == "diverged" and st.get("step") is not None:
            if w is not None and w <= st["step"]:
                judged = f"lead {st['step'] - w} steps"
                leads.append(st["step"] - w)
            elif st["step"] <= warn_rule.after_step:
                judged = f"too early to warn (monitor.warning_after_step={warn_rule.after_step})"
                too_early += 1
            else:
                judged = "missed (no warning before divergence)"
        elif s == "survived":
            stable += 1
            judged = "false alarm" if w is not None else "quiet"
            false_alarms += w is not None
        onsets = replays[key].onsets if key in replays else []
        md.append(f"| {spec.name} | {spec.seed} | {len(spec.cells)} | {s} | {st.get('step', '')} | "
                  f"{_cell(st.get('reason', ''))} | {'' if w is None else f'on at {w}'} | {judged} | "
                  f"{_cell(onsets[0].describe(), 400) if onsets else ''} |")
    diverged = sum(1 for key, st in status.items() if st.get("status") == "diverged"
                   and not (switches and warnings.get(key) is not None)) - too_early
    early = (f" ({too_early} more diverged by step {warn_rule.after_step}, before the rule may warn)"
             if too_early else "")
    if switched:
        early += (f"; {switched} arm(s) switched to fix={config.monitor.switch_fix_to} at their warning "
                  "(monitor.on_warning=switch_fix) are counted in neither")
    warn_line = (f"Early warning ({warn_rule.describe()}; thresholds monitor.warning_*): warned before "
                 f"divergence on {len(leads)} of {diverged} diverged arms{early}"
                 + (f" (lead time median {int(np.median(leads))} steps, min {min(leads)}, max {max(leads)})"
                    if leads else "") + f"; false alarms on {false_alarms} of {stable} stable arms.")
    md += ["", "## Early warning", "", warn_line, "",
           "Per rule (each enabled signal alone at its threshold, then the rule; 'in time': lead >= min(300, 25% of "
           "the steps to divergence); the calibration on other grids: python -m analysis.warning_calibration):", ""]
    md += table(rule_scores(warn_rule, {k: r for k, r in replays.items() if k in {a.key for a in arms}}, arms))
    md += [""]
    measured = _measured_costs(scalars)
    if measured:
        md += ["## Measured (to calibrate the estimate)", "", measured, ""]
    md += ["## What this run length can show", "", _what_it_shows(max_steps), ""]
    figures = _figures(plan, scalars, status, warnings, out, max_steps)
    md += ["## Figures", ""] + [f"![{cap}]({name})" for name, cap in figures]
    (out / "margin.md").write_text("\n".join(md) + "\n")
    (out / "margin.html").write_text(_html(experiment_dir.name, md, figures, out))
    print("\n".join(line for line in md if not line.startswith("![")))
    print(f"[margin] report: {out / 'margin.html'}", flush=True)
    return out / "margin.html"


def pool_seeds(per_seed: list[dict[float, Outcome]]) -> dict[float, Outcome]:
    """One outcome per gain over seeds: diverged if any seed diverged there, survived if all survived, else
    unknown; ``step`` of a pooled divergence is the number of seeds that diverged."""
    out = {}
    for g in (per_seed[0] if per_seed else {}):
        cells = [o[g] for o in per_seed]
        diverged = [c for c in cells if c.status == "diverged"]
        if diverged:
            out[g] = Outcome("diverged", all(c.observed for c in diverged), len(diverged))
        elif all(c.status == "survived" for c in cells):
            out[g] = Outcome("survived", all(c.observed for c in cells))
        else:
            out[g] = Outcome("none", False)
    return out


def _pooled_text(margin: Optional[Margin], pooled: Optional[dict]) -> str:
    if margin is None or not pooled:
        return "n/a"
    text = _mtext(margin)
    if margin.smallest_diverged is not None:
        n = pooled[margin.smallest_diverged].step
        text += f" ({n} seed{'s' if n != 1 else ''})"
    return text


def _mtext(margin: Optional[Margin]) -> str:
    if margin is None:
        return "n/a"
    return margin.text() + (" (implied)" if margin.implied else "")


def _cell(text: str, limit: int = 160) -> str:
    return str(text).replace("|", "/")[:limit]


def arm_outcomes(plan, status: dict, outcomes: dict, margins: dict, max_steps: int) -> list[ArmOutcome]:
    """The judged arms (diverged or survived) as the warning calibration reads them (margin_report/arms.json); an arm
    is 'below the margin' when it survived at the gain just below its series' smallest diverging gain."""
    below = set()
    for sid, gains in plan.series.items():
        smallest = margins[sid].smallest_diverged
        ordered = [g for g, _ in gains]
        if smallest is None or ordered.index(smallest) == 0:
            continue
        gain, key = gains[ordered.index(smallest) - 1]
        if outcomes[sid][gain].status == "survived" and outcomes[sid][gain].observed:
            below.add(key)
    arms = []
    for key, spec in plan.arms.items():
        st = status.get(key, {})
        if st.get("status") not in ("diverged", "survived"):
            continue
        cell = spec.cells[0]
        one = len(spec.cells) == 1
        arms.append(ArmOutcome(key, cell.numerics, cell.gain if one else None, cell.sign if one else None, spec.seed,
                               st["status"], int(st.get("step") or max_steps), key in below))
    return arms


def _measured_costs(scalars: dict) -> str:
    step_times = [float(np.median(sc[tags.STEP_TIME_S][1])) for sc in scalars.values() if tags.STEP_TIME_S in sc]
    memory = [float(np.max(sc[tags.MAX_MEMORY_GB][1])) for sc in scalars.values() if tags.MAX_MEMORY_GB in sc]
    parts = []
    if step_times:
        parts.append(f"median seconds per step per arm (perf/step_time_s, with the arms that ran alongside): "
                     f"{np.median(step_times):.3f} (set margin.step_seconds)")
    if memory:
        parts.append(f"largest peak GPU memory of an arm (perf/max_memory_gb): {max(memory):.1f} GB "
                     "(set margin.arm_memory_gb a little above)")
    return "; ".join(parts)


def _what_it_shows(steps: int) -> str:
    return (f"Each arm trains {steps} steps. A gain that survives here may still diverge in a longer run (the paper's "
            "GPT-2 small failed near step 7,000; in the project's 1,600-step margin grid on an H200, docs/results.md, "
            "the kept-sign arms that diverged did so between steps 620 and 1,490), so 'survives' means 'within these "
            "steps'. The margin compares numerics under the same "
            "length, data and seed; it is not a prediction of when a normal run (gain 1) fails.")


def max_wq_head(sc: dict, layer: int = 1):
    """(steps, largest per-head W_Q spectral norm of ``layer``) from an arm's scalars, or None."""
    heads = [sc[t] for t in sc if (p := tags.parse(t)) and p.family == "spectral" and p.stat == "wq"
             and p.layer == layer and p.head is not None]
    if not heads:
        return None
    steps = heads[0][0]
    values = np.max(np.stack([h[1][:len(steps)] for h in heads if len(h[1]) >= len(steps)]), axis=0)
    return steps, values


def lowest_head(sc: dict, family: str, stat: str, layer: int = 1):
    """(steps, lowest value over heads) of a per-head statistic (e.g. qk_update entropy) of ``layer``, or None."""
    heads = [sc[t] for t in sc if (p := tags.parse(t)) and p.family == family and p.stat == stat
             and p.layer == layer and p.head is not None]
    if not heads:
        return None
    steps = heads[0][0]
    return steps, np.nanmin(np.stack([h[1][:len(steps)] for h in heads if len(h[1]) >= len(steps)]), axis=0)


def _figures(plan, scalars, status, warnings, out: Path, max_steps: int) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = plan.config
    gains = sorted(m.gains)
    cmap = plt.get_cmap("plasma")
    color = {g: cmap(0.85 * i / max(1, len(gains) - 1)) for i, g in enumerate(gains)}
    figures = []
    for numerics in m.numerics:
        keys = [k for k, a in plan.arms.items() if a.cells[0].numerics == numerics and scalars.get(k)]
        rounding = numerics.split("/")[0]
        # the same rounding with the reference's own delta (no delta error), drawn grey as the others' reference
        reference_fix = REFERENCE_FIX[m.reference] if m.stress == "delta" else None  # output: every fix has one
        refs = [k for k, a in plan.arms.items() if a.cells[0].numerics == f"{rounding}/{reference_fix}"
                and scalars.get(k) and k not in keys]
        name = f"curves_{numerics.replace('/', '-')}.png"
        # fourth panel: the early warning's default input (pre-softmax score entropy) where the probe logged it,
        # else the Q-K update entropy; a grid may have measured neither (monitor.qk_activation / qk_update off)
        entropy_family, entropy_title = next(
            ((family, title) for family, title in
             (("qk_act", "L01 pre-softmax score spectral entropy (lowest head; the early warning's input)"),
              ("qk_update", "L01 Q-K update spectral entropy, first order (lowest head)"))
             if any(lowest_head(scalars[k], family, "entropy") for k in keys + refs)),
            ("qk_act", "L01 score / Q-K update entropy"))
        fig, axes = plt.subplots(1, 4, figsize=(21, 4.4))
        # scale: None linear, "log" (W_Q norms are > 0), "symlog" (tie rates from 1% to ~40%, and 0 stays visible)
        panels = [("train loss (nats)", lambda sc: sc.get(tags.TRAIN_LOSS), None),
                  ("L01 largest W_Q head spectral norm", lambda sc: max_wq_head(sc, 1), "log"),
                  ("L01 tie rate (probe batch; linear below 0.001)", lambda sc: sc.get(tags.attn(1, "tie_rate")),
                   "symlog"),
                  (entropy_title, lambda sc: lowest_head(sc, entropy_family, "entropy"), None)]
        for ax, (title, get, log) in zip(axes, panels):
            drawn = False
            for key in refs + keys:
                spec = plan.arms[key]
                cell = spec.cells[0]
                series = get(scalars[key])
                if series is None or not len(series[0]):
                    continue
                steps, values = series
                if title.startswith("train"):
                    values = smooth(values, 5)
                collapsed = len(spec.cells) > 1 and len({c.gain for c in spec.cells}) > 1
                c = "0.6" if key in refs else "k" if collapsed else color.get(cell.gain, "k")
                ls = "--" if cell.sign == "random" and not collapsed else "-"
                label = (f"{cell.numerics} (reference)" if key in refs else
                         f"all gains ({cell.numerics})" if collapsed else f"g={cell.gain:g} {cell.sign}")
                if len(m.seeds) > 1:
                    label += f" s{spec.seed}"
                finite = np.isfinite(values)
                if log == "log":
                    finite &= values > 0
                ax.plot(steps[finite], values[finite], ls, color=c, lw=1.4, label=label)
                drawn = True
                st = status.get(key, {})
                if st.get("status") == "diverged" and st.get("step") is not None and finite.any():
                    ax.axvline(st["step"], color=c, ls=":", lw=0.9)
                w = warnings.get(key)
                if w is not None and title.startswith("train"):
                    ax.plot([w], [np.interp(w, steps[finite], values[finite])], "v", color=c, ms=7)
            if not drawn:  # say so rather than leave an empty frame that reads as "flat"
                ax.text(0.5, 0.5, "not measured in this grid", ha="center", va="center", transform=ax.transAxes,
                        color="0.4")
                log = None
            if log == "symlog":
                ax.set_yscale("symlog", linthresh=1e-3)
                ax.set_ylim(bottom=0)
            elif log:
                ax.set_yscale("log")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("optimizer step")
            ax.set_xlim(0, max_steps)
            ax.grid(alpha=0.3, which="both")
        axes[0].set_ylabel("nats (trailing mean of 5 logged points)")
        handles, labels = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                       title="gain, sign (dashed: random)")
        fig.suptitle(f"{numerics}: dotted vertical line = divergence step, triangle = early warning onset; "
                     "curves end where a diverged arm was stopped"
                     + (f"; grey = {rounding}/{reference_fix}" if refs else ""),
                     fontsize=10)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        figures.append((name, f"{numerics}: loss, layer 1's largest W_Q head norm, tie rate and "
                              f"{'score' if entropy_family == 'qk_act' else 'Q-K update'} entropy per arm"))
    return figures


def _html(title: str, md: list[str], figures: list[tuple[str, str]], out: Path) -> str:
    body, table = [], []

    def flush_table():
        if not table:
            return
        rows = [r.strip().strip("|").split("|") for r in table if not set(r.replace("|", "").strip()) <= set("-")]
        body.append("<table>" + "".join(
            "<tr>" + "".join(f"<{'th' if i == 0 else 'td'}>{html.escape(c.strip())}</{'th' if i == 0 else 'td'}>"
                             for c in row) + "</tr>" for i, row in enumerate(rows)) + "</table>")
        table.clear()

    for line in md:
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("!["):
            continue
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            body.append(f"<p>{html.escape(line).replace('**', '')}</p>")
    flush_table()
    for name, caption in figures:
        data = base64.b64encode((out / name).read_bytes()).decode("ascii")
        body.append(f"<figure><img alt='{html.escape(name)}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + html.escape(f"margin: {title}") +
            "</title><style>body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
            "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px}"
            "img{max-width:100%;border:1px solid #ddd}</style></head><body>" + "\n".join(body) + "</body></html>")
