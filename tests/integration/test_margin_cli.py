"""``python -m analysis.margin`` end to end on CPU: two arms of a smoke-size model on the embedded corpus (arms that
differ in attention.fix, fields every checkout has) trained side by side for tens of steps, the report written; a
rerun trains nothing and rewrites the report; Ctrl-C saves every arm and the same command resumes them. Plumbing
only: nothing diverges at this size (the rules are tested in tests/unit/test_margin.py)."""

import json
from pathlib import Path

from tests.runs import launch

TINY = ["margin.numerics=[paper/none,paper/fp32_output]", "margin.gains=[1]", "margin.signs=[kept]",
        "margin.processes=2", "margin.progress_seconds=5", "margin.budget_minutes=5", "margin.step_seconds=0.2",
        "margin.startup_seconds=10", "precision.dtype=auto", "run.max_steps=20",
        "model.n_layer=2", "model.d_model=128", "model.n_head=2", "model.max_seq_len=64", "data.seq_len=64",
        "data.global_batch_size=4", "data.micro_batch_size=4", "optim.warmup_steps=5", "eval.interval=0",
        "monitor.spectral_interval=5", "monitor.probe_interval=5", "monitor.delta_bias_layers=[]",
        "monitor.warning_after_step=5", "monitor.warning_window=10"]


def test_margin_cli_two_arms(tmp_path, kjv_data):
    # kjv_data: the embedded corpus prepared once per test session (conftest.py)
    args = ["margin", *TINY, f"data.data_dir={kjv_data}", f"run.out_dir={tmp_path}", "run.experiment=m"]
    proc = launch(args, module="analysis.margin", timeout=300)
    out = proc.stdout
    assert "2 cells -> 2 distinct runs" in out and "estimate:" in out
    assert "survived 20 steps" in out and "[margin] report:" in out
    report = tmp_path / "m" / "margin_report"
    for name in ("margin.md", "margin.html", "curves_paper-none.png", "curves_paper-fp32_output.png"):
        assert (report / name).is_file(), name
    table = (report / "margin.md").read_text()
    assert "| paper-none_g1_kept | 1337 |" in table and "| paper-fp32_output | 1337 |" in table
    state = json.loads((tmp_path / "m" / "margin_state.json").read_text())
    assert {a["status"] for a in state["arms"].values()} == {"survived"}
    arm = tmp_path / "m" / "seed_1337" / "paper-none_g1_kept"
    assert (arm / "checkpoints").is_dir()
    from launcher.compare import load_scalars
    from launcher.monitors import tags

    assert tags.WARNING in load_scalars(arm)  # the early-warning flag is logged by every run's monitors
    # the same command again: every arm is judged already, so nothing trains; the report is written again
    again = launch(args, module="analysis.margin", timeout=120).stdout
    assert "[margin] start" not in again and "[margin] report:" in again


def test_margin_ctrl_c_saves_and_the_rerun_resumes(tmp_path, kjv_data):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.runs import REPO, launcher_env

    # far more steps than either leg can train: the legs end by Ctrl-C and by margin.max_minutes, never by finishing
    # (400 steps finished inside 0.4 min on an idle machine)
    args = ["margin", *TINY, f"data.data_dir={kjv_data}", "run.max_steps=1000000", "margin.budget_minutes=0", "run.log_interval=5",
            f"run.out_dir={tmp_path}", "run.experiment=m"]
    log = tmp_path / "m" / "seed_1337" / "logs" / "paper-none_g1_kept.log"
    with subprocess.Popen([sys.executable, "-m", "analysis.margin", *args], cwd=REPO, env=launcher_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.monotonic() + 120
        while not (log.is_file() and "step     10/" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the arm never logged step 10"
            time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "the same command resumes" in out
    state = json.loads((tmp_path / "m" / "margin_state.json").read_text())
    assert {a["status"] for a in state["arms"].values()} == {"interrupted"}, state
    # the same command resumes the arms from the checkpoints they saved; margin.max_minutes (not part of the arms'
    # recipe) stops it again by itself, the way a fixed-length allocation would
    again = launch([*args, "margin.max_minutes=0.4"], module="analysis.margin", timeout=180, check=False)
    assert again.returncode == 130, again.stdout[-3000:]
    assert "margin.max_minutes=0.4 spent" in again.stdout and "resumed from" in log.read_text()
    state = json.loads((tmp_path / "m" / "margin_state.json").read_text())
    assert {a["status"] for a in state["arms"].values()} == {"interrupted"}, state


def test_a_grid_larger_than_the_machine_is_refused_and_the_plan_needs_no_data(tmp_path, kjv_data):
    """--machine simulates a small CPU machine: four arms of ~0.5 GB at once do not fit in 1 GB. The refusal is one
    line naming the value to set, before any folder exists. --dry-run shows the plan before the data is prepared."""
    import subprocess
    import sys

    from tests.runs import REPO, launcher_env

    def margin(*args):
        return subprocess.run([sys.executable, "-m", "analysis.margin", "margin", *TINY, "margin.processes=4",
                               f"run.out_dir={tmp_path}", "run.experiment=m", *args], cwd=REPO, env=launcher_env(),
                              capture_output=True, text=True, timeout=120)

    refused = margin(f"data.data_dir={kjv_data}", "--machine", "cpus=8,memory_gb=1")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not fit this CPU machine" in lines[0] and lines[0].endswith(
        "set margin.processes=1"), refused.stderr
    assert not (tmp_path / "m").exists()
    plan = margin(f"data.data_dir={tmp_path / 'not_prepared'}", "--dry-run", "--machine", "cpus=8,memory_gb=16")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "holds no prepared data" in plan.stdout and "seed_1337/paper-none_g1_kept: attention" in plan.stdout


def test_a_killed_arm_is_named_and_retried_by_the_same_command(tmp_path, kjv_data):
    """kill -9 of one arm's process mid-run (as the out-of-memory killer does): the console names the signal, the
    same command starts the arm again from its checkpoint, and the console and the report agree it survived."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.runs import REPO, launcher_env

    args = ["margin", *TINY, f"data.data_dir={kjv_data}", f"run.out_dir={tmp_path}", "run.experiment=m",
            "run.max_steps=30", "run.log_interval=1", "checkpoint.interval=4", "margin.budget_minutes=0"]
    log = tmp_path / "m" / "seed_1337" / "logs" / "paper-none_g1_kept.log"
    with subprocess.Popen([sys.executable, "-m", "analysis.margin", *args], cwd=REPO, env=launcher_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.monotonic() + 120
        while not (log.is_file() and "step      9/" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the arm never logged step 9"
            time.sleep(0.1)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        arm = next(pid for pid in map(int, children)
                   if b"paper-none_g1_kept" in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(arm, signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "seed_1337/paper-none_g1_kept KILLED by SIGKILL (likely the out-of-memory killer) after step" in out
    assert "starting it again (1 of margin.retries=2)" in out and "resumed from" in log.read_text()
    state = json.loads((tmp_path / "m" / "margin_state.json").read_text())
    assert {a["status"] for a in state["arms"].values()} == {"survived"}, state
    assert "| paper-none_g1_kept | 1337 | 1 | survived |" in (tmp_path / "m" / "margin_report" / "margin.md").read_text()
