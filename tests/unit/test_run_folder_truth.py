"""A run folder never lies (issue 21): a command that will fail deletes nothing, a resume with other settings is
refused unless allowed (and then recorded), a replay is of exactly the recorded batches. Subprocess CLI tests."""

import hashlib

import yaml

from tests.unit.test_user_mistakes import cli, one_line_error


def snapshot(folder):
    """Every file under ``folder`` with its content hash: equal snapshots mean nothing was deleted or rewritten."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_overwrite_without_resume_false_fails_before_deleting(tiny_overrides, tmp_path):
    args = ["smoke", *tiny_overrides, "--arm", "baseline", "run.max_steps=3"]
    assert cli(*args).returncode == 0
    before = snapshot(tmp_path / "runs")
    out = one_line_error(cli(*args, "run.overwrite=true"))
    assert "add checkpoint.resume=false to start over" in out and "removed" not in out, out
    assert snapshot(tmp_path / "runs") == before


def test_a_resume_with_other_settings_is_refused_unless_allowed_and_then_recorded(tiny_overrides, tmp_path):
    run_dir = tmp_path / "runs" / "smoke" / "baseline"
    args = ["smoke", *tiny_overrides, "--arm", "baseline", "optim.decay_steps=0"]
    assert cli(*args, "run.max_steps=3").returncode == 0
    config = (run_dir / "config.yaml").read_text()
    before = snapshot(tmp_path / "runs")
    out = one_line_error(cli(*args, "run.max_steps=3", "optim.lr=1e-3"))  # a finished run: would train nothing
    assert "optim.lr: 0.003 -> 0.001" in out and "run.allow_changes=true" in out, out
    out = one_line_error(cli(*args, "run.max_steps=4"))  # the cosine would end at step 4, not 3
    assert "optim.decay_steps: 3 -> 4" in out and "set optim.decay_steps=3" in out, out
    assert snapshot(tmp_path / "runs") == before

    longer = cli(*args, "run.max_steps=4", "optim.decay_steps=3")  # same schedule, longer: safe
    assert longer.returncode == 0 and "run.max_steps 3 -> 4" in longer.stdout, longer.stdout + longer.stderr
    allowed = cli(*args, "run.max_steps=5", "optim.decay_steps=3", "optim.min_lr=1e-4", "run.allow_changes=true")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert (run_dir / "config.yaml").read_text() == config  # the settings the run started with
    changes = yaml.safe_load((run_dir / "changes.yaml").read_text())
    assert [(c["step"], sorted(c["changes"])) for c in changes] == [
        (3, ["run.max_steps"]), (4, ["optim.min_lr", "run.max_steps"])]
    assert changes[1]["changes"]["optim.min_lr"] == {"from": 3e-5, "to": 1e-4}


def test_a_replay_with_another_batch_size_is_refused(tiny_overrides, tmp_path):
    assert cli("smoke", *tiny_overrides, "--arm", "baseline").returncode == 0  # 6 steps x 4 = 24 offsets
    recorded = tmp_path / "runs" / "smoke" / "baseline" / "batch_offsets.bin"
    out = one_line_error(cli("smoke", *tiny_overrides, "--arm", "baseline", "run.experiment=replay",
                             f"data.replay_from={recorded}", "data.global_batch_size=2", "run.max_steps=12"))
    assert "global_batch_size=4 there, 2 here" in out and "Set data.global_batch_size=4" in out, out
    assert not (tmp_path / "runs" / "replay").exists()


def test_arm_typos_and_empty_recipes_are_named(tmp_path):
    for override, message in [
        ("arms.fixd.attention.fix=none", "the recipe has no arm 'fixd'. Did you mean 'fixed'?"),
        ("arms.fixed.atention.fix=none", "unknown key 'arms.fixed.atention'. Did you mean 'attention'?"),
        ("arms.fixed.attention.fix=nope", "arms.fixed.attention.fix='nope' is not one of"),
    ]:
        out = one_line_error(cli("smoke", override, "--dry-run"))
        assert message in out, out
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    assert "is empty" in one_line_error(cli(str(tmp_path / "empty.yaml"), "--dry-run"))


def compare_cli(*args):
    import subprocess
    import sys

    from tests.runs import REPO, launcher_env

    return subprocess.run([sys.executable, "-m", "launcher.compare", *args], cwd=REPO, env=launcher_env(),
                          capture_output=True, text=True, timeout=120)


def test_compare_refuses_what_is_not_an_experiment_folder(tmp_path):
    from tests.unit.test_compare import write_synthetic_arm

    write_synthetic_arm(tmp_path / "runs" / "smoke" / "baseline", diverges=False, seed=1)
    (tmp_path / "runs" / "smoke" / "fixed").mkdir()  # an arm that has not logged yet
    (tmp_path / "notes.md").write_text("")
    (tmp_path / ".git").mkdir()
    before = snapshot(tmp_path)
    for folder, message in [(tmp_path / "runs", "holds experiments (smoke), not arms"),
                            (tmp_path / "runs" / "smoke" / "baseline", "is the folder of one arm"),
                            (tmp_path / "notes.md", "is a file, not an experiment folder. Experiments in")]:
        proc = compare_cli(str(folder))
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert ".git" not in proc.stderr
    assert snapshot(tmp_path) == before  # no report, no layout file written anywhere


def test_missing_data_hint_names_a_source(tiny_overrides, tmp_path):
    out = one_line_error(cli("smoke", *tiny_overrides, f"data.data_dir={tmp_path / 'owt'}"))
    assert f"--source <your .txt/.jsonl/.parquet files or folder, or a cached Hugging Face dataset name> --out " \
           f"{tmp_path / 'owt'}" in out, out
    out = one_line_error(cli("smoke", *tiny_overrides, "data.data_dir=README.md"))
    assert "data.data_dir=README.md is a file, not a data folder" in out and "--out README.md" not in out, out
    assert not (tmp_path / "runs").exists()


def test_the_report_says_which_loss_is_which_and_what_the_run_length_shows(tmp_path, capsys):
    from launcher import compare
    from tests.unit.test_compare import write_synthetic_arm

    exp = tmp_path / "runs" / "synthetic"
    write_synthetic_arm(exp / "baseline", diverges=True, seed=1)
    write_synthetic_arm(exp / "fixed", diverges=False, seed=2)
    compare.write_report(exp, quiet=True)
    summary = (exp / "report" / "summary.txt").read_text()
    assert "final train loss" in summary and "(last logged, step 600; mean of the last 10 logged points" in summary
    assert "layer whose W_Q spectral norm grew most: L01 (x6.93, in arm baseline)" in summary, summary
    for kind in ("loss", "grad_norm", "spectral", "wq_heads", "delta_bias", "tie_rate", "max_logit"):
        assert compare.panel_note(120, kind).startswith("120 steps: ")
        assert compare.panel_note(120, kind) != compare.panel_note(7000, kind)
    assert "fc_out x10 is normal" in compare.panel_note(120, "spectral")
    assert "one early event" in compare.panel_note(120, "delta_bias")
    html = (exp / "report" / "report.html").read_text()
    assert "should stay dark" not in html and "compare the arms row by row" in html
    assert "diverge at step 300" in summary and "long before the step at which the paper's failure" in summary
