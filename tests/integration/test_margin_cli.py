"""``python -m launcher.margin`` end to end on CPU: two arms of a smoke-size model on the embedded corpus (arms that
differ in attention.fix, fields every checkout has) trained side by side for tens of steps, the report written; a
rerun trains nothing and rewrites the report; Ctrl-C saves every arm and the same command resumes them. Plumbing
only: nothing diverges at this size (the rules are tested in tests/unit/test_margin.py)."""

import json

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
    proc = launch(args, module="launcher.margin", timeout=300)
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
    again = launch(args, module="launcher.margin", timeout=120).stdout
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
    with subprocess.Popen([sys.executable, "-m", "launcher.margin", *args], cwd=REPO, env=launcher_env(),
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
    again = launch([*args, "margin.max_minutes=0.4"], module="launcher.margin", timeout=180, check=False)
    assert again.returncode == 130, again.stdout[-3000:]
    assert "margin.max_minutes=0.4 spent" in again.stdout and "resumed from" in log.read_text()
    state = json.loads((tmp_path / "m" / "margin_state.json").read_text())
    assert {a["status"] for a in state["arms"].values()} == {"interrupted"}, state
