"""The comparison on two synthetic runs written here: every file, the planted divergence, clear errors."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from launcher import compare
from launcher.monitors import tags

REPO = Path(__file__).resolve().parents[2]
DIVERGE_AT = 300
LAYERS, HEADS = 3, 4


def write_synthetic_arm(run_dir: Path, diverges: bool, seed: int) -> None:
    """A run logged like the trainer and the monitors: loss every 10 steps, monitors every 50, eval every 100.

    Both arms share the loss curve and noise until DIVERGE_AT, where the diverging arm's loss jumps; before that its
    W_Q of layer 1 (heads 0 and 2) grows and its delta bias accumulates one sign."""
    rng = np.random.default_rng(seed)
    shared = np.random.default_rng(0)
    writer = SummaryWriter(str(run_dir))
    for step in range(10, 601, 10):
        loss = 6.0 * math.exp(-step / 150) + 3.0 + 0.02 * shared.standard_normal()
        if diverges and step >= DIVERGE_AT:
            loss += 4.0
        writer.add_scalar(tags.TRAIN_LOSS, loss, step)
        writer.add_scalar(tags.TRAIN_GRAD_NORM, 1.0 + 0.1 * shared.random() + (5.0 if diverges and step >= DIVERGE_AT else 0), step)
        if step % 100 == 0:
            writer.add_scalar(tags.EVAL_LOSS, loss + 0.1, step)
    for step in [1] + list(range(50, 601, 50)):
        for layer in range(LAYERS):
            for w in tags.WEIGHTS:
                grow = 1.0 + (step / 100 if diverges and layer == 1 and w == "wq" else 0.01 * step / 100)
                writer.add_scalar(tags.spectral(layer, w), grow * (1.0 + 0.1 * layer), step)
            for h in range(HEADS):
                grow = 1.0 + (step / 100 if diverges and layer == 1 and h in (0, 2) else 0.0)
                writer.add_scalar(tags.spectral(layer, "wq", h), 0.5 * grow, step)
                writer.add_scalar(tags.spectral(layer, "wk", h), 0.5, step)
            cum = (step * 0.1 if diverges else rng.standard_normal()) * (layer + 1)
            writer.add_scalar(tags.delta_bias(layer, "cum"), cum, step)
            writer.add_scalar(tags.attn(layer, "tie_rate"), 0.01 + (0.2 if diverges and layer == 1 else 0.0), step)
            writer.add_scalar(tags.attn(layer, "max_logit"), 5.0 + layer, step)
    writer.close()


@pytest.fixture
def experiment(tmp_path):
    exp = tmp_path / "runs" / "synthetic"
    write_synthetic_arm(exp / "baseline", diverges=True, seed=1)
    write_synthetic_arm(exp / "fixed", diverges=False, seed=2)
    return exp


EXPECTED_PNGS = {"loss.png", "grad_norm.png", "spectral_heatmap_baseline.png", "spectral_heatmap_fixed.png",
                 "wq_heads.png", "delta_bias_cum.png", "tie_rate.png", "max_logit.png", "warning_timeline.png"}


def test_report_has_every_file_and_finds_the_planted_divergence(experiment, capsys):
    report = compare.write_report(experiment)
    out_dir = experiment / "report"
    assert report == out_dir / "report.html"
    assert EXPECTED_PNGS <= {p.name for p in out_dir.glob("*.png")}
    for png in EXPECTED_PNGS:
        assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.read_text()
    assert text.count("data:image/png;base64,") == len(EXPECTED_PNGS)  # self-contained: images embedded
    assert "http://" not in text and "https://" not in text
    summary = (out_dir / "summary.txt").read_text()
    assert f"fixed vs baseline: diverge at step {DIVERGE_AT}" in summary
    assert "grew most: L01" in summary
    # a short run with a divergence: not called rounding noise, pointed at the monitors
    assert "what this shows: " in summary and "long before the step at which the paper" in summary
    assert summary.strip() in capsys.readouterr().out
    layout_files = list(experiment.rglob("events.out.tfevents.*.layout"))
    assert len(layout_files) == 1 and layout_files[0].parent.parent == experiment  # in an arm: no run of its own
    compare.write_report(experiment, quiet=True)  # running again replaces the layout instead of adding one
    assert len(list(experiment.rglob("events.out.tfevents.*.layout"))) == 1


def test_layout_overlays_arms_chart_by_chart(experiment):
    arms = compare.find_arms(experiment)
    assert [a.name for a in arms] == ["baseline", "fixed"]
    layout = compare.custom_scalar_layout(arms, compare.layer_that_grew_most(arms))
    charts = {title: spec for category in layout.values() for title, spec in category.items()}
    assert charts["spectral/L01/wq"] == ["Multiline", ["^spectral/L01/wq$"]]
    assert "spectral/L01/wq/h02" in charts and "delta_bias/L00/cum" in charts and "train/loss" in charts


def test_divergence_criterion():
    steps = np.arange(10, 210, 10)
    a = np.full(len(steps), 3.0)
    b = a.copy()
    b[steps >= 100] = 3.6        # +20% from step 100
    b[steps == 50] = 6.0         # one outlier: not k consecutive
    ref, other = (steps, a), (steps, b)
    assert compare.find_divergence(ref, other, 0.05, 3, 1).step == 100
    assert compare.find_divergence(ref, other, 0.05, 1, 1).step == 50
    assert compare.find_divergence(ref, other, 0.5, 3, 1).step is None
    # smoothing over 4 points spreads the outlier (detected at 50 with 3 consecutive) and delays the step:
    # without the outlier, the trailing mean is 3.15 (+5%) at step 100 and 3.3 (+10%) at 110
    assert compare.find_divergence(ref, other, 0.06, 3, 4).step == 50
    b[steps == 50] = 3.0
    assert compare.find_divergence(ref, (steps, b), 0.06, 3, 4).step == 110
    b_nan = a.copy()
    b_nan[steps >= 150] = np.nan  # a NaN loss counts as diverged
    assert compare.find_divergence(ref, (steps, b_nan), 0.05, 2, 1).step == 150


def test_clear_errors_without_traceback(tmp_path, capsys):
    missing = subprocess.run([sys.executable, "-m", "launcher.compare", str(tmp_path / "nope")], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2
    assert "compare: error: no experiment folder" in missing.stderr and "Traceback" not in missing.stderr
    (tmp_path / "empty" / "baseline").mkdir(parents=True)
    assert compare.main([str(tmp_path / "empty")]) == 2
    assert "holds no arm with TensorBoard events" in capsys.readouterr().err
    with pytest.raises(compare.CompareError):
        compare.write_report(tmp_path / "empty", divergence_threshold=0.0)


def _ended_arm(run_dir: Path, status: str, step: int, max_steps: int = 600, reason: str = "",
               logged: int = 600) -> None:
    """A synthetic arm with the ending the trainer records (launcher/arm_status.py), its loss logged to ``logged``."""
    from launcher.arm_status import write_status

    writer = SummaryWriter(str(run_dir))  # the loss only: the other panels are tested above
    for s in range(10, logged + 1, 10):
        writer.add_scalar(tags.TRAIN_LOSS, 6.0 * math.exp(-s / 150) + 3.0, s)
    writer.close()
    write_status(run_dir, status, step, max_steps, reason)


def test_every_ending_is_named_in_the_summary(tmp_path):
    """stopped (with the guard's record), killed (running, lock free), crashed, interrupted: each arm's ending leads
    its line, the outcome line leads the summary, and an arm that blew up while another trained on is said so."""
    import yaml

    from launcher.run_folder import RunLock

    exp = tmp_path / "endings"
    _ended_arm(exp / "baseline", "stopped", 310, reason="gradient norm is inf", logged=300)
    (exp / "baseline" / "bad_step_00000310.yaml").write_text(yaml.safe_dump(
        {"step": 310, "problem": "gradient norm is inf", "loss": 812.5, "grad_norm": float("inf")}))
    _ended_arm(exp / "fixed", "completed", 600)
    _ended_arm(exp / "killed", "running", 0)
    _ended_arm(exp / "crashed", "crashed", 0, reason="RuntimeError: out of memory")
    _ended_arm(exp / "paused", "interrupted", 400, reason="stopped by a signal at step 400; the same command resumes",
               logged=400)
    compare.write_report(exp, quiet=True)
    summary = (exp / "report" / "summary.txt").read_text()
    first = summary.splitlines()[0]
    assert first.startswith("outcome: BLEW UP: baseline stopped by the guard at step 310 (gradient norm is inf)")
    assert "  killed: killed after step 600 (" in summary and "out-of-memory killer" in summary
    assert "  crashed: crashed after step 600 (RuntimeError: out of memory)" in summary
    assert "  paused: interrupted: stopped by a signal at step 400" in summary
    assert "fixed trained on to step 600" in summary and "numerics decided it" in summary
    assert "rounding noise" not in summary
    assert "<b>outcome: BLEW UP" in (exp / "report" / "report.html").read_text()
    # an arm whose run folder is locked is still training: not an ending, and not called killed
    lock = RunLock(exp / "killed").acquire()
    try:
        arms = {a.name: a for a in compare.find_arms(exp)}
        assert arms["killed"].ending.status == "running" and not arms["killed"].ending.ended
    finally:
        lock.release()


def test_a_finite_blow_up_is_not_called_complete(tmp_path):
    """The guard lets any finite loss through: an arm that completed with its loss far above where it started blew
    up all the same."""
    exp = tmp_path / "rose"
    for name in ("baseline", "fixed"):
        writer = SummaryWriter(str(exp / name))
        for step in range(1, 21):
            writer.add_scalar(tags.TRAIN_LOSS, 7.6 + ((step - 1) * 1e4 if name == "fixed" else -0.1 * step), step)
        writer.close()
    summary = compare.summarize(compare.find_arms(exp), [], dict(compare.DEFAULT_CRITERIA), None)
    assert "fixed completed 20 steps but blew up without a non-finite value (its train loss rose from 7.6" in summary


def test_a_delta_stress_pair_is_read_as_the_margin_test(tmp_path):
    """recipes/demo.yaml's arms (the same amplified delta error with its own and with random signs, and the fixed
    arm): the report says in one sentence which sign broke training, read from the arms' recorded attention."""
    import yaml

    exp = tmp_path / "demo"
    attention = {"fixed": {"rounding": "paper", "fix": "fp32_output"},
                 "kept": {"rounding": "paper", "fix": "none", "delta_gain": 300.0, "delta_sign": "kept"},
                 "random": {"rounding": "paper", "fix": "none", "delta_gain": 300.0, "delta_sign": "random"}}
    for name, att in attention.items():
        writer = SummaryWriter(str(exp / name))
        for step in range(20, 1001, 20):
            loss = 6.0 * math.exp(-step / 300) + 4.5 + (0.004 * (step - 500) if name == "kept" and step > 500 else 0)
            writer.add_scalar(tags.TRAIN_LOSS, loss, step)
        writer.close()
        (exp / name / "config.yaml").write_text(yaml.safe_dump({"attention": att, "run": {"max_steps": 1000}}))
    arms = compare.find_arms(exp)
    divergences = [compare.find_divergence(arms[0].get(tags.TRAIN_LOSS), a.get(tags.TRAIN_LOSS), 0.05, 5, 10,
                                           ("fixed", a.name)) for a in arms[1:]]
    summary = compare.summarize(arms, divergences, dict(compare.DEFAULT_CRITERIA), None)
    step = divergences[0].step
    assert step is not None and divergences[1].step is None
    assert (f"what this shows: the delta error amplified 300x with its own sign (kept) diverged from the reference "
            f"arm at step {step}, while the same error with random signs (random) trained on") in summary
    assert "the persistent sign, not the error's size, is what breaks training" in summary


class _Arm:
    """What warning_timeline reads of an arm: its folder (config.yaml), name and logged series."""

    def __init__(self, path: Path, last_step: int):
        steps = np.arange(10, last_step + 1, 10)
        self.path, self.name = path, path.name
        self.scalars = {tags.WARNING: (steps, np.zeros(len(steps)))}

    def get(self, tag):
        return self.scalars.get(tag)


@pytest.mark.parametrize("last_step, expected", [
    (120, "no onset possible: the rule starts at step 200 (monitor.warning_after_step), after this run's last "
          "monitor step 120"),
    (400, "no onset over 40 monitor steps"),
])
def test_warning_summary_says_when_a_run_ended_before_the_rule_starts(tmp_path, last_step, expected):
    from launcher.warning_timeline import summary_lines

    (tmp_path / "arm").mkdir()
    (tmp_path / "arm" / "config.yaml").write_text("monitor: {warning_after_step: 200}\n")
    assert f"  arm: {expected}" in summary_lines([_Arm(tmp_path / "arm", last_step)]).splitlines()
