"""The warning calibration (analysis/warning_calibration.py) on two synthetic margin grids written as event files:
thresholds chosen on one grid and judged on the other, through the margin report's arms.json."""

import json
import math

import pytest

from analysis import margin_report
from launcher.config import Config
from analysis.margin import MarginConfig, STATE_FILE, expand, save_state
from launcher.monitors import tags
from analysis.warning_calibration import ARMS_FILE, Score, ArmOutcome, main


def make_grid(root, seed: int, diverge: dict[str, int], lead: int, on_warning: str = "log",
              warn_only: dict[str, int] | None = None):
    """A margin grid of paper/none and fa2/none at gains 10 and 50, both signs; the arms in ``diverge`` blow up at
    their step. Before that, layer 1's first-order Q-K update entropy drops in one head ``lead`` steps ahead (in both
    roundings); the tie rate climbs only in the paper arms (FP32 scores tie rarely). The arms in ``warn_only`` show
    the same signals from their step on and do not blow up (an arm that switched fix at its warning)."""
    from torch.utils.tensorboard import SummaryWriter

    grid = MarginConfig(numerics=["paper/none", "fa2/none"], gains=[10, 50], signs=["kept", "random"], seeds=[seed],
                        schedule="full")
    plan = expand(grid)
    config = Config()
    config.run.max_steps = 1600
    config.monitor.warning_tie_rate = 0.05
    config.monitor.warning_qk_update_drop = 0.2
    config.monitor.on_warning = on_warning
    warn_only = warn_only or {}
    state = {"version": 1, "arms": {}}
    for key, spec in plan.arms.items():
        d = diverge.get(spec.name)
        paper = spec.name.startswith("paper")
        writer = SummaryWriter(str(root / key))
        end = d + 30 if d else 1600
        for s in range(10, end + 1, 10):
            writer.add_scalar(tags.TRAIN_LOSS, 3 + 3 * math.exp(-s / 150) + (4.0 if d and s >= d else 0.0), s)
            writer.add_scalar(tags.TRAIN_GRAD_NORM, 0.5, s)
            if s % 50:
                continue
            wiggle = 0.01 * math.sin(0.37 * s + seed)
            failing = (d is not None and s >= d - lead) or s >= warn_only.get(spec.name, 10 ** 9)
            writer.add_scalar(tags.attn(1, "tie_rate"), (0.2 if failing else 0.01) if paper else 0.001, s)
            for h in range(2):
                entropy = 0.8 + wiggle * (h + 1) - (0.4 if failing and h == 1 else 0.0)
                writer.add_scalar(tags.qk_update(1, "entropy", h), entropy, s)
        writer.close()
        state["arms"][key] = {"status": "diverged" if d else "survived", "step": d or 1600}
    save_state(root / STATE_FILE, state)
    margin_report.write_report(root, plan, config)
    return plan


def test_arms_json_marks_the_arms_one_gain_below_the_margin(tmp_path):
    make_grid(tmp_path, 7, {"paper-none_g50_kept": 800}, lead=300)
    arms = {a["key"]: a for a in json.loads((tmp_path / "margin_report" / ARMS_FILE).read_text())}
    assert arms["seed_7/paper-none_g50_kept"]["status"] == "diverged"
    assert arms["seed_7/paper-none_g50_kept"]["step"] == 800
    assert arms["seed_7/paper-none_g10_kept"]["below_margin"]
    assert not any(a["below_margin"] for k, a in arms.items() if k != "seed_7/paper-none_g10_kept")
    text = (tmp_path / "margin_report" / "margin.md").read_text()
    assert "| qk_update_drop | 0.2 |" in text and "| tie_rate | 0.05 |" in text  # the per-rule table
    assert "qk_update_drop 0.457 > 0.2 on L01 h01" in text  # the onset explained in the arms table
    assert "numerics signals agree" in text


def test_an_arm_switched_at_its_warning_is_no_false_alarm_and_stays_out_of_the_calibration(tmp_path):
    # monitor.on_warning=switch_fix: two arms warned (fa2/none g50 kept at step ~500, paper/none g50 kept 300 steps
    # before its blow-up at 800); the first trained on after its switch, the second diverged anyway. Neither is a
    # false alarm nor a warned divergence (what it would have done unswitched is not observed)
    make_grid(tmp_path, 7, {"paper-none_g50_kept": 800}, lead=300, on_warning="switch_fix",
              warn_only={"fa2-none_g50_kept": 500})
    text = (tmp_path / "margin_report" / "margin.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| fa2-none_g50_kept |"))
    assert "switched to fix=fp32_output at the warning; survived" in row and "false alarm" not in row
    row = next(line for line in text.splitlines() if line.startswith("| paper-none_g50_kept |"))
    assert "switched to fix=fp32_output at the warning; diverged anyway at 800" in row
    assert "false alarms on 0 of 6 stable arms" in text and "2 arm(s) switched" in text
    keys = {a["key"] for a in json.loads((tmp_path / "margin_report" / ARMS_FILE).read_text())}
    assert "seed_7/fa2-none_g50_kept" not in keys and "seed_7/paper-none_g50_kept" not in keys
    assert len(keys) == 6


def test_thresholds_chosen_on_one_grid_hold_on_the_other(tmp_path, capsys):
    cal, held = tmp_path / "cal", tmp_path / "held"
    make_grid(cal, 1, {"paper-none_g50_kept": 800, "fa2-none_g50_kept": 1200}, lead=350)
    make_grid(held, 2, {"paper-none_g50_kept": 700, "fa2-none_g50_kept": 1100, "paper-none_g50_random": 1400},
              lead=400)
    capsys.readouterr()
    assert main(["--calibrate", str(cal), "--holdout", str(held), "monitor.warning_after_step=200"]) == 0
    text = (held / "warning_calibration" / "calibration.md").read_text()
    held_out = text.split("## Held-out grids")[1]
    row = next(line for line in held_out.splitlines() if line.startswith("| qk_update_drop |"))
    assert "| 2 of 2 (2 in time) | 1 of 1 (1 in time) |" in row and row.endswith("| yes |")
    ties = next(line for line in held_out.splitlines() if line.startswith("| tie_rate |"))
    assert "| 0 of 1 (0 in time) |" in ties and "fa2 warned 0%" in ties  # the paper's signal misses fa2
    assert "Best single signal out of sample: **qk_update_drop >" in text
    assert (held / "warning_calibration" / "signal_qk_update_drop.png").is_file()


def test_score_counts_leads_in_time_and_false_alarms():
    arms = [ArmOutcome("a", "paper/none", 50, "kept", 1, "diverged", 1000),
            ArmOutcome("b", "fa2/none", 100, "kept", 1, "diverged", 400),
            ArmOutcome("c", "fa2/none", 50, "kept", 1, "survived", 1600, below_margin=True),
            ArmOutcome("d", "paper/none", 10, "random", 1, "survived", 1600)]
    score = Score.of(arms, {"a": 800, "b": 390, "c": 1500})
    assert score.warned == {"paper": 1, "fa2": 1} and score.useful == {}  # leads 200 < 250 and 10 < 100
    assert score.leads == [200, 10] and score.false_alarms == 1 and score.below_false_alarms == 1
    met, missed = score.targets()
    assert not met and "false alarms 50%" in missed
    late = Score.of(arms, {"a": 1001})  # a warning after the divergence is a miss
    assert late.warned == {} and late.leads == []


def test_cli_mistakes_exit_2(tmp_path, capsys):
    assert main(["--calibrate", str(tmp_path), "--holdout", str(tmp_path)]) == 2
    assert "in both --calibrate and --holdout" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    assert main(["--calibrate", str(tmp_path), "--holdout", str(tmp_path / "other")]) == 2
    assert "arms.json is missing" in capsys.readouterr().err
    assert main(["--calibrate", str(tmp_path), "--holdout", str(tmp_path / "other"), "optim.lr=1"]) == 2
    assert "only monitor.* overrides" in capsys.readouterr().err
