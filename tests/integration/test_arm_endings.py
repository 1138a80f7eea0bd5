"""Every way an arm can end reaches the report (issue 35): a blown-up pair of arms, through the command line."""

import re

from tests.runs import launch


def test_a_guard_stopped_pair_gets_a_report_that_says_so(tiny_overrides, tmp_path):
    """optim.lr=50: the guard stops an arm at a non-finite gradient norm. The report is written all the same, and
    its summary, HTML and loss panel say which arm stopped, at which step and why; nothing calls it noise."""
    proc = launch(["smoke", *tiny_overrides, "optim.lr=50", "optim.min_lr=0", "optim.decay_steps=0",
                   "run.max_steps=20"], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out  # docs/training.md: 3 when a guard stopped an arm
    stopped = dict(re.findall(r"\[(\w+)\] BAD STEP (\d+): ", proc.stdout))
    assert stopped, out  # at lr 50 at least one arm blows up within 20 steps
    report = tmp_path / "runs" / "smoke" / "report"
    summary = (report / "summary.txt").read_text()
    html = (report / "report.html").read_text()
    for arm, step in stopped.items():
        said = f"{arm} stopped by the guard at step {step} ("
        assert said in summary and said in html, summary
        assert f"[summary] {arm}: stopped by the guard" in proc.stdout
    assert summary.startswith("outcome: BLEW UP: ")
    assert "rounding noise" not in summary and "rounding noise" not in html
    assert "blew up" in summary.split("what this shows: ")[1]
    assert (report / "loss.png").is_file()
    status = (tmp_path / "runs" / "smoke" / next(iter(stopped)) / "status.yaml").read_text()
    assert "status: stopped" in status
