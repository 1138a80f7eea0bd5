"""What a new user runs into, through the command line (subprocesses): one-line errors with exit code 2 and nothing
half-made, a run folder that belongs to one run at a time, batch offsets that survive a deleted file."""

import subprocess
import sys

import numpy as np
import pytest

from launcher.run_folder import RunLock, start_fresh_or_resume
from tests.runs import REPO, launcher_env, scalars


def cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "launcher.pretrain", *args], cwd=cwd, env=launcher_env(),
                          capture_output=True, text=True, timeout=300)


def one_line_error(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    return out


@pytest.mark.parametrize("override, message", [
    ("model.d_model=100", "for example set model.d_model=128"),
    ("run.device=cuda", "no CUDA GPU is visible"),
    ("precision.fp8_ffn=true", "precision.fp8_ffn=true needs a CUDA GPU"),
])
def test_impossible_settings_stop_before_any_folder_exists(tiny_overrides, tmp_path, override, message):
    for extra in ([], ["--dry-run"]):
        out = one_line_error(cli("smoke", *tiny_overrides, override, *extra))
        assert message in out
        assert not (tmp_path / "runs").exists()


def test_non_finite_numbers_are_refused_in_one_line_and_every_problem_at_once(tiny_overrides, tmp_path):
    """optim.lr=nan once passed validation, made the run folder and its lock, and ended in torch's traceback."""
    for value, said in (("nan", "nan"), (".inf", "inf")):  # YAML reads .inf as a float, nan as a string
        proc = cli("smoke", *tiny_overrides, f"optim.lr={value}")
        out = one_line_error(proc)
        assert out.strip().splitlines() == [f"error: optim.lr must be a finite number, got {said}"], out
        assert not (tmp_path / "runs").exists()
    out = one_line_error(cli("smoke", *tiny_overrides, "optim.lr=nan", "model.n_layer=two", "run.device=cuda",
                             "arms.fixed.attention.fix=nope"))
    assert "invalid configuration (4 problems)" in out and "no CUDA GPU is visible" in out, out
    assert not (tmp_path / "runs").exists()


def test_an_output_folder_that_cannot_be_made_is_named(tiny_overrides, tmp_path):
    (tmp_path / "a_file").write_text("")
    out = one_line_error(cli("smoke", *tiny_overrides, f"run.out_dir={tmp_path / 'a_file' / 'runs'}"))
    assert "is a file, not a folder" in out
    out = one_line_error(cli("smoke", *tiny_overrides, "run.out_dir=/proc/no/runs"))
    assert "cannot create folders in /proc" in out


def test_a_second_run_of_the_same_arm_is_refused(tiny_overrides, tmp_path):
    run_dir = tmp_path / "runs" / "smoke" / "baseline"
    lock = RunLock(run_dir).acquire()  # as a first run holds it while training
    try:
        out = one_line_error(cli("smoke", *tiny_overrides, "--arm", "baseline"))
        assert "is in use by pid" in out
    finally:
        lock.release()
    assert cli("smoke", *tiny_overrides, "--arm", "baseline").returncode == 0  # free again


def test_a_fresh_start_in_a_used_folder_needs_overwrite(tiny_overrides, tmp_path):
    args = ["smoke", *tiny_overrides, "--arm", "baseline"]
    assert cli(*args).returncode == 0
    out = one_line_error(cli(*args, "checkpoint.resume=false"))
    assert "set run.overwrite=true" in out
    final = tmp_path / "runs" / "smoke" / "baseline" / "checkpoints" / "step_00000006"
    with open(final / "__0_0.distcp", "r+b") as f:  # the only checkpoint, damaged: still an earlier run that only
        f.truncate(100)                             # overwrite removes
    assert "set run.overwrite=true" in one_line_error(cli(*args, "checkpoint.resume=false"))
    out = one_line_error(cli(*args))
    assert "no intact checkpoint to resume" in out and \
        "step_00000006 is damaged (truncated: __0_0.distcp has 100 of" in out, out
    assert final.with_name(final.name + ".damaged").exists()  # kept for inspection
    assert "set run.overwrite=true" in one_line_error(cli(*args, "checkpoint.resume=false"))  # also once renamed
    proc = cli(*args, "checkpoint.resume=false", "run.overwrite=true", "run.max_steps=3", "optim.decay_steps=6")
    assert proc.returncode == 0 and "started over" in proc.stdout, proc.stdout + proc.stderr
    losses = scalars(tmp_path / "runs" / "smoke" / "baseline", "train/loss")
    assert sorted(losses) == [1, 2, 3]  # only the new run's events


def test_a_run_killed_inside_its_first_save_starts_over(tmp_path):
    """Only partial files are left (no checkpoint yet): the next start clears them. step_N.tmp matches two of the
    run-file patterns; it once was listed twice and the second delete failed (CI, 2026-12-01)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    leftovers = [folder / "step_00000004.tmp", tmp_path / "batch_offsets.bin"]
    leftovers[0].mkdir()
    (leftovers[0] / "__0_0.distcp").write_bytes(b"partial")
    leftovers[1].write_bytes(b"partial")
    message = start_fresh_or_resume(tmp_path, latest=None, resume=True, overwrite=False)
    assert "removed 2 file(s)" in message
    assert not any(path.exists() for path in leftovers)


def test_deleted_batch_offsets_are_rebuilt_on_resume(tiny_overrides, tmp_path):
    args = ["smoke", *tiny_overrides, "--arm", "baseline", "checkpoint.interval=3"]
    assert cli(*args, "run.experiment=straight").returncode == 0
    assert cli(*args, "run.experiment=cut", "run.max_steps=3").returncode == 0
    offsets = tmp_path / "runs" / "cut" / "baseline" / "batch_offsets.bin"
    offsets.unlink()
    assert cli(*args, "run.experiment=cut").returncode == 0
    straight = tmp_path / "runs" / "straight" / "baseline" / "batch_offsets.bin"
    assert offsets.read_bytes() == straight.read_bytes() and len(np.fromfile(offsets, dtype=np.int64)) == 6 * 4


def test_a_replay_shorter_than_the_run_is_refused(tiny_overrides, tmp_path):
    assert cli("smoke", *tiny_overrides, "--arm", "baseline", "run.max_steps=3", "optim.decay_steps=3").returncode == 0
    recorded = tmp_path / "runs" / "smoke" / "baseline" / "batch_offsets.bin"
    out = one_line_error(cli("smoke", *tiny_overrides, "--arm", "baseline", "run.experiment=replay",
                             f"data.replay_from={recorded}"))
    assert "holds the offsets of 3 steps; run.max_steps=6 needs 6" in out
    assert not (tmp_path / "runs" / "replay").exists()


def test_overrides_the_arms_replace_are_refused_and_arm_runs_explain_the_report(tiny_overrides, tmp_path):
    out = one_line_error(cli("smoke", *tiny_overrides, "attention.fix=foo"))
    assert "would be replaced by the recipe's arms" in out and "arms.fixed.attention.fix=..." in out
    first = cli("smoke", *tiny_overrides, "--arm", "baseline")
    assert first.returncode == 0 and "python -m launcher.compare" in first.stdout and "fixed" in first.stdout
    second = cli("smoke", *tiny_overrides, "--arm", "fixed")
    assert second.returncode == 0 and "report: " in second.stdout, second.stdout
    assert (tmp_path / "runs" / "smoke" / "report" / "report.html").is_file()


def prepare_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "launcher.prepare_data", *args], cwd=cwd, env=launcher_env(),
                          capture_output=True, text=True, timeout=300)


def test_prepare_data_names_bad_files_and_keeps_other_prepared_folders(tmp_path):
    texts = tmp_path / "my_texts"
    texts.mkdir()
    (texts / "a.txt").write_text("First document.\n\nSecond document, a little longer.\n\nThird one.\n")
    (texts / "empty.txt").write_text("")
    out = one_line_error(prepare_cli("--source", str(texts), cwd=tmp_path))
    assert f"{texts / 'empty.txt'} is empty" in out
    assert not (tmp_path / "data").exists()  # a refusal leaves no empty output folder
    (texts / "empty.txt").write_bytes(bytes(range(128, 256)))
    assert "is not UTF-8 text" in one_line_error(prepare_cli("--source", str(texts), cwd=tmp_path))
    (texts / "empty.txt").unlink()
    done = prepare_cli("--source", str(texts), "--vocab-size", "600", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # not a terminal: no progress bars (their carriage-return updates piled up in logs), one line per stage
    assert "\r" not in done.stdout + done.stderr and "[prepare] tokenizing and writing train.bin" in done.stdout
    assert (tmp_path / "data" / "cache" / "my_texts" / "meta.json").is_file()  # named after the source
    # a folder prepared from another source is not replaced without --force
    out = one_line_error(prepare_cli("--source", "kjv", "--out", "data/cache/my_texts", cwd=tmp_path))
    assert "already holds data prepared from" in out and "--force" in out
