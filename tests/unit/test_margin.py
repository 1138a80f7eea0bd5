"""The margin tool's pure parts (analysis/margin.py, analysis/margin_report.py, launcher/monitors/warning.py): grid
expansion and collapsing, the bisection schedule, the estimate, the divergence rule and the margins on synthetic
curves, the early-warning rule on synthetic series, and the report on synthetic event files."""

import math
import subprocess
import sys

import numpy as np
import pytest

from analysis import margin_report as mr
from launcher.config import ConfigError
from analysis.margin import (Machine, MarginConfig, bisect_path, estimate, expand, fit_problems, margin_problems,
                             next_arms, parse_progress)
from launcher.monitors import tags
from launcher.monitors.warning import EarlyWarning, WarningRule, evaluate
from tests.runs import REPO

ALL = ["paper/none", "paper/dynamic_max", "paper/fp32_output", "fa2/none", "fa2/dynamic_max", "fa2/fp32_output"]


def test_grid_collapses_redundant_cells():
    plan = expand(MarginConfig(numerics=ALL, gains=[0, 1, 5, 20], signs=["kept", "random"], seeds=[1, 2]))
    per_seed = [a for a in plan.arms.values() if a.seed == 1]
    # 4 numerics with a delta error: gain 0 (one run for both signs) + 3 gains x 2 signs; fp32_output: one run each
    assert len(per_seed) == 4 * (1 + 3 * 2) + 2
    fp32 = plan.arms["seed_1/paper-fp32_output"]
    assert len(fp32.cells) == 4 * 2 and fp32.attention == {"rounding": "paper", "fix": "fp32_output"}
    mode = plan.arms["seed_1/fa2-none_g1_kept"]
    assert mode.attention == {"rounding": "fa2", "fix": "none"}  # the mode itself: no delta fields
    assert plan.arms["seed_1/fa2-none_g1_random"].attention["delta_sign"] == "random"
    zero = plan.arms["seed_2/paper-none_g0"]
    assert {c.sign for c in zero.cells} == {"kept", "random"} and zero.attention["delta_gain"] == 0.0
    assert any("collapsed" in n for n in plan.notes)


def test_exact_reference_gives_fp32_output_a_margin_and_collapses_exact_delta():
    """margin.reference=exact: the gains amplify delta_mode - delta_exact, so fp32_output's cells are runs of their
    own (with attention.delta_reference=exact) and exact_delta, which has no error against it, is one run."""
    plan = expand(MarginConfig(numerics=["fa2/fp32_output", "fa2/exact_delta"], gains=[0, 1, 10],
                               signs=["kept", "random"], seeds=[1], reference="exact"))
    assert set(plan.arms) == {"seed_1/fa2-fp32_output_g0", "seed_1/fa2-fp32_output_g1_kept",
                              "seed_1/fa2-fp32_output_g1_random", "seed_1/fa2-fp32_output_g10_kept",
                              "seed_1/fa2-fp32_output_g10_random", "seed_1/fa2-exact_delta"}
    assert plan.arms["seed_1/fa2-fp32_output_g10_kept"].attention == {
        "rounding": "fa2", "fix": "fp32_output", "delta_gain": 10.0, "delta_sign": "kept", "delta_reference": "exact"}
    assert plan.arms["seed_1/fa2-fp32_output_g1_kept"].attention == {"rounding": "fa2", "fix": "fp32_output"}
    assert len(plan.arms["seed_1/fa2-exact_delta"].cells) == 6
    assert "margin.reference" in margin_problems(MarginConfig(reference="fp64"))[0]


def test_output_stress_amplifies_every_fix():
    """margin.stress=output: the arms set attention.output_gain / output_sign, and no fix collapses (each one's O has
    a rounding error; fp32_output's too)."""
    plan = expand(MarginConfig(numerics=["fa2/fp32_output"], gains=[1, 10], signs=["kept", "random"], seeds=[1],
                               stress="output"))
    assert plan.arms["seed_1/fa2-fp32_output_g10_random"].attention == {
        "rounding": "fa2", "fix": "fp32_output", "output_gain": 10.0, "output_sign": "random"}
    assert len(plan.arms) == 4
    assert "margin.stress" in margin_problems(MarginConfig(stress="both"))[0]


@pytest.mark.parametrize("threshold", [1, 5, 7, 20, 50, 100, 1000])
def test_bisection_finds_the_boundary_in_few_runs(threshold):
    gains = [1, 5, 10, 20, 50, 100]
    plan = expand(MarginConfig(numerics=["paper/none"], gains=gains, signs=["kept"], seeds=[0]))
    status, runs = {}, 0
    while True:
        todo = next_arms(plan, lambda k: status.get(k, {}).get("status"), set())
        if not todo:
            break
        key = todo[0]
        gain = plan.arms[key].cells[0].gain
        status[key] = {"status": "diverged" if gain >= threshold else "survived", "step": 100}
        runs += 1
    assert runs <= math.ceil(math.log2(len(gains) + 1))
    outcomes = mr.series_outcomes(plan.series[("paper/none", "kept", 0)], status, bisect=True)
    margin = mr.margin_of(outcomes)
    survived = [g for g in gains if g < threshold]
    diverged = [g for g in gains if g >= threshold]
    assert margin.largest_survived == (max(survived) if survived else None)
    assert margin.smallest_diverged == (min(diverged) if diverged else None)
    assert all(o.status == ("diverged" if g >= threshold else "survived") for g, o in outcomes.items())


def test_full_schedule_runs_every_cell_middle_first_and_idle_slots_speculate():
    plan = expand(MarginConfig(numerics=["fa2/none"], gains=[1, 5, 10, 20, 50], signs=["kept"], seeds=[0],
                               schedule="full"))
    order = next_arms(plan, lambda k: None, set())
    assert len(order) == 5 and order[0].endswith("g10_kept")
    bis = expand(MarginConfig(numerics=["fa2/none"], gains=[1, 5, 10, 20, 50], signs=["kept"], seeds=[0]))
    first = next_arms(bis, lambda k: None, set())
    assert first == ["seed_0/fa2-none_g10_kept"]
    # while g=10 runs, a free slot takes the gains either outcome needs next
    spec = next_arms(bis, lambda k: None, {"seed_0/fa2-none_g10_kept"})
    assert set(spec) == {"seed_0/fa2-none_g1_kept", "seed_0/fa2-none_g20_kept"}


def test_estimate_and_budget_error():
    grid = MarginConfig(numerics=ALL, processes=16, step_seconds=0.15, startup_seconds=30, budget_minutes=15)
    plan = expand(grid)
    est = estimate(plan, 1500)
    assert est.runs == 4 * 2 * 3 + 2 and est.rounds == 3
    big = Machine(cpus=64, memory_gb=512.0)
    assert fit_problems(plan, 1500, big, 4.0) == []  # 3 rounds x 4.25 min
    grid.schedule = "full"
    problems = fit_problems(expand(grid), 1500, big, 4.0)
    assert problems and "margin.budget_minutes=15" in problems[0] and "run.max_steps" in problems[0]
    grid.schedule, grid.processes = "bisect", 40
    assert "margin.processes=" in fit_problems(expand(grid), 10, Machine(gpu_gb=80.0), 0.0)[0]


def test_a_cpu_machine_is_sized_by_cores_and_host_memory():
    """16 arms of ~6 GB on a 2-core, 23 GB machine (issue 35: the out-of-memory killer fired ~10 times)."""
    plan = expand(MarginConfig(numerics=["paper/none"], gains=[1, 10], processes=16, budget_minutes=0))
    by_cores = fit_problems(plan, 100, Machine(cpus=2, memory_gb=23.0), 6.0)
    assert by_cores == ["margin.processes=16 arms at once do not fit this CPU machine (2 core(s)): set "
                        "margin.processes=2"]
    by_memory = fit_problems(plan, 100, Machine(cpus=32, memory_gb=23.0), 6.0)[0]
    assert "23.0 GB of host memory available, ~6.0 GB per arm" in by_memory and by_memory.endswith("processes=3")
    assert "shrink the arm" in fit_problems(plan, 100, Machine(cpus=2, memory_gb=4.0), 6.0)[0]
    assert Machine.parse("cpus=2,memory_gb=8") == Machine(cpus=2, memory_gb=8.0)
    with pytest.raises(ConfigError, match="not one of gpu_gb, cpus, memory_gb"):
        Machine.parse("ram=8")


def test_margin_problems_say_what_to_change():
    assert margin_problems(MarginConfig()) == []
    bad = margin_problems(MarginConfig(numerics=["paper"], gains=[-1], signs=["both"], schedule="smart"))
    assert len(bad) == 4
    assert "rounding/fix" in bad[0] and "margin.gains" in bad[1] and "kept, random" in bad[2]


def test_parse_progress_line():
    line = "[a] step     50/120 | loss 6.2417 | lr 2.43e-03 | grad norm 0.588 | 4,660 tok/s | MFU n/a | 0.220 s/step"
    assert parse_progress(line) == (50, 6.2417, 0.588)
    assert parse_progress("[a] step     50/120 | loss nan | lr 1e-3 | grad norm inf |")[1] != 1.0
    assert parse_progress("[a] step    500 | eval loss 4.2") is None


# ----------------------------------------------------------------------------------------------------------------
# Divergence rule and margins on synthetic curves


def _curve(steps, base=3.0, jump_at=None, jump=2.0, grad=0.5, grad_jump=None):
    loss = [base + 2.0 * math.exp(-s / 200) + (jump if jump_at is not None and s >= jump_at else 0.0) for s in steps]
    grads = [grad * (30 if grad_jump is not None and s >= grad_jump else 1) for s in steps]
    return list(steps), loss, grads


def test_judge_flags_the_jumping_arm_only():
    steps = range(10, 1010, 10)
    rule = mr.DivergenceRule(loss_margin=1.0, grad_factor=10, patience=3, min_arms=3)
    curves = {f"s{i}": _curve(steps, base=3.0 + 0.05 * i) for i in range(4)}
    curves["bad"] = _curve(steps, jump_at=500)
    curves["grad"] = _curve(steps, grad_jump=700)
    verdicts = mr.judge(curves, rule)
    assert set(verdicts) == {"bad", "grad"}
    assert verdicts["bad"].step == 500 and "median" in verdicts["bad"].reason
    assert verdicts["grad"].step == 700 and "grad norm" in verdicts["grad"].reason


def test_judge_patience_nonfinite_and_own_minimum():
    steps = list(range(10, 110, 10))
    rule = mr.DivergenceRule(patience=3, min_arms=3)
    spike = _curve(steps)
    spike[1][4] += 5.0  # one logged point: not a divergence
    nan = _curve(steps)
    nan[1][6] = float("nan")
    stable = [_curve(steps) for _ in range(2)]
    verdicts = mr.judge({"spike": spike, "nan": nan, "a": stable[0], "b": stable[1]}, rule)
    assert set(verdicts) == {"nan"} and verdicts["nan"].step == 70
    alone = _curve(steps, jump_at=60)  # fewer than min_arms: its own lowest loss is the reference
    v = mr.judge({"alone": alone}, rule)["alone"]
    assert v.step == 60 and "own lowest" in v.reason


def test_bias_verdict_control():
    def outcomes(threshold, gains=(1, 10, 20, 50)):
        return {g: mr.Outcome("diverged" if g >= threshold else "survived", True, 10) for g in gains}

    kept, random_ok, random_bad = outcomes(20), outcomes(50), outcomes(20)
    mk = mr.margin_of(kept)
    assert (mk.largest_survived, mk.smallest_diverged) == (10, 20)
    assert mr.bias_verdict(mk, mr.margin_of(random_ok), kept, random_ok).startswith("bias")
    assert mr.bias_verdict(mk, mr.margin_of(random_bad), kept, random_bad).startswith("size, not bias")
    never = outcomes(1000)
    assert "never diverged" in mr.bias_verdict(mr.margin_of(never), mr.margin_of(never), never, never)
    odd = {1: mr.Outcome("diverged", True, 5), 10: mr.Outcome("survived", True)}
    assert not mr.margin_of(odd).monotone


# ----------------------------------------------------------------------------------------------------------------
# Early warning on synthetic series


def _series(steps, fn):
    return np.array(steps), np.array([fn(s) for s in steps], dtype=float)


def test_warning_tie_rate_and_growth():
    rule = WarningRule(layer=1, tie_rate=0.1, wq_growth=2.0, window=200, after_step=100, patience=2)
    steps = list(range(0, 2001, 25))
    quiet = {tags.attn(1, "tie_rate"): _series(steps, lambda s: 0.5 if s < 100 else 0.01),  # high only at the start
             tags.spectral(1, "wq", 0): _series(steps, lambda s: 6 + 0.004 * s),
             tags.spectral(1, "wq", 1): _series(steps, lambda s: 5.0)}
    assert evaluate(rule, quiet)[0] is None
    ties = dict(quiet)
    ties[tags.attn(1, "tie_rate")] = _series(steps, lambda s: 0.01 if s < 1000 else 0.3)
    assert evaluate(rule, ties)[0] == 1025  # two consecutive monitor steps above 0.1
    grow = dict(quiet)
    grow[tags.spectral(1, "wq", 1)] = _series(steps, lambda s: 5.0 if s < 1200 else 5.0 * math.exp((s - 1200) / 100))
    first, flags = evaluate(rule, grow)
    assert first is not None and 1200 < first <= 1400
    other_layer = {tags.attn(2, "tie_rate"): _series(steps, lambda s: 0.9)}
    assert evaluate(rule, other_layer) == (None, [])


def test_warning_state_resumes_exactly():
    rule = WarningRule(window=100, after_step=0, patience=2)
    feed = [(s, {tags.attn(1, "tie_rate"): 0.2 if s % 200 else 0.0, tags.spectral(1, "wq", 0): 1.0 + s / 50})
            for s in range(0, 1000, 20)]
    whole = EarlyWarning(rule)
    a = [whole.update(s, v) for s, v in feed]
    first = EarlyWarning(rule)
    b = [first.update(s, v) for s, v in feed[:23]]
    resumed = EarlyWarning(rule)
    resumed.load_state_dict(first.state_dict())
    b += [resumed.update(s, v) for s, v in feed[23:]]
    assert a == b and any(x.get(tags.WARNING) for x in a)


# ----------------------------------------------------------------------------------------------------------------
# The report on synthetic event files, and config errors


@pytest.mark.parametrize("seeds", [[7], [7, 8]])
def test_report_on_synthetic_events(tmp_path, seeds):
    from torch.utils.tensorboard import SummaryWriter

    from launcher.config import Config
    from analysis.margin import STATE_FILE, save_state

    grid = MarginConfig(numerics=["paper/none", "paper/fp32_output"], gains=[1, 10, 20, 50], signs=["kept", "random"],
                        seeds=seeds, schedule="full")
    plan = expand(grid)
    config = Config()
    config.run.max_steps = 1000
    config.monitor.warning_window = 200
    diverge = {"paper-none_g20_kept": 600, "paper-none_g50_kept": 400, "paper-none_g50_random": 450}
    state = {"version": 1, "arms": {}}
    for key, spec in plan.arms.items():
        d = diverge.get(spec.name)
        writer = SummaryWriter(str(tmp_path / key))
        end = d + 30 if d else 1000
        for s in range(10, end + 1, 10):
            loss = 3 + 3 * math.exp(-s / 150) + (4.0 if d and s >= d else 0.0)
            writer.add_scalar(tags.TRAIN_LOSS, loss, s)
            writer.add_scalar(tags.TRAIN_GRAD_NORM, 0.5, s)
            if s % 50 == 0:
                grow = math.exp(max(0, s - (d - 300)) / 80) if d else 1.0
                writer.add_scalar(tags.attn(1, "tie_rate"), min(0.4, 0.01 * grow), s)
                for h in range(2):
                    writer.add_scalar(tags.spectral(1, "wq", h), 6 + h + 0.002 * s * grow, s)
        writer.close()
        state["arms"][key] = {"status": "diverged" if d else "survived", "step": d or 1000}
    save_state(tmp_path / STATE_FILE, state)
    page = mr.write_report(tmp_path, plan, config)
    text = (tmp_path / "margin_report" / "margin.md").read_text()
    assert page.is_file() and (tmp_path / "margin_report" / "curves_paper-none.png").is_file()
    assert "| paper/none | 7 | survives 10 / diverges 20 | survives 20 / diverges 50 |" in text
    assert "bias: random sign survives g=20 where kept diverges" in text
    assert "lead " in text and f"of {3 * len(seeds)} diverged arms" in text
    if len(seeds) > 1:
        assert "| paper/none | survives 10 / diverges 20 (2 seeds) | survives 20 / diverges 50 (2 seeds) |" in text
    for spec in plan.arms.values():
        assert f"| {spec.name} |" in text


@pytest.mark.parametrize("override,needle", [("margin.gains=[-1,5]", "margin.gains"),
                                             ("margin.numerics=[paper]", "rounding/fix"),
                                             ("margin.sings=[kept]", "did you mean"),
                                             ("attention.fix=dynamic_max", "margin.numerics")])
def test_config_errors_are_one_line_exit_2(override, needle):
    proc = subprocess.run([sys.executable, "-m", "analysis.margin", "margin", override, "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle.lower() in lines[0].lower(), proc.stderr
    assert "Traceback" not in proc.stderr


def test_seeds_pool_into_one_margin():
    def outcomes(threshold):
        return {g: mr.Outcome("diverged" if g >= threshold else "survived", True, 10) for g in (1, 10, 20, 50)}

    pooled = mr.pool_seeds([outcomes(20), outcomes(50)])
    margin = mr.margin_of(pooled)
    assert (margin.largest_survived, margin.smallest_diverged) == (10, 20)
    assert pooled[20].step == 1 and pooled[50].step == 2  # seeds that diverged there
    assert mr._pooled_text(margin, pooled).endswith("(1 seed)")


def test_a_killed_arm_stays_killed_in_the_report_and_retry_failed_starts_it(tmp_path, capsys):
    """A killed arm's curves stop where its process died: the report names it killed (as the console did) instead of
    judging its curves, and the too-early divergence of another arm is not counted as a missed warning."""
    from torch.utils.tensorboard import SummaryWriter

    from launcher.config import Config
    from analysis.margin import STATE_FILE, Runner, save_state

    plan = expand(MarginConfig(numerics=["paper/none"], gains=[1, 10, 20], signs=["kept"], schedule="full",
                               min_arms=1))
    keys = list(plan.arms)
    for key in keys:
        writer = SummaryWriter(str(tmp_path / key))
        for s in range(10, 101 if key != keys[1] else 41, 10):  # keys[1] was killed at step 40, loss far up
            writer.add_scalar(tags.TRAIN_LOSS, 5.0 + (20.0 if key == keys[1] else 0.0), s)
            writer.add_scalar(tags.TRAIN_GRAD_NORM, 0.5, s)
        writer.close()
    save_state(tmp_path / STATE_FILE, {"version": 1, "arms": {
        keys[0]: {"status": "survived", "step": 100},
        keys[1]: {"status": "killed", "step": 40, "reason": "killed by SIGKILL (likely the out-of-memory killer)"},
        keys[2]: {"status": "diverged", "step": 30, "reason": "non-finite loss"}}})
    config = Config()
    config.run.max_steps = 100
    mr.write_report(tmp_path, plan, config)
    text = (tmp_path / "margin_report" / "margin.md").read_text()
    assert "| paper-none_g10_kept | 1337 | 1 | killed | 40 | killed by SIGKILL (likely the out-of-memory killer) |" in text
    assert "judged by the report" not in text and "| S | killed | D@30 |" in text
    assert "too early to warn (monitor.warning_after_step=200)" in text and "missed" not in text
    runner = Runner(plan, {}, tmp_path, 100, 10, retry_failed=True)
    assert "--retry-failed: 1 arm(s) start again: " + keys[1] in capsys.readouterr().out
    assert next_arms(plan, runner.status_of, set()) == [keys[1]]
