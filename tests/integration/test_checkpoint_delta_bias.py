"""The delta bias of a trained checkpoint end to end: train the tiny smoke recipe a few steps with checkpoints, then
measure the run through the CLI (subprocess) and read its table."""

import subprocess
import sys

from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.trainer import train_arm
from tests.runs import REPO, launcher_env


def measure(*args):
    return subprocess.run([sys.executable, "-m", "analysis.checkpoint_delta_bias", *map(str, args)], cwd=REPO,
                          env=launcher_env(), capture_output=True, text=True, timeout=300)


def table_rows(stdout: str, columns: int) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("| ")]
    return [r for r in rows if len(r) == columns and r[0].isdigit()]


def test_delta_bias_of_a_trained_checkpoint(tiny_overrides, tmp_path):
    config = load_config("smoke", tiny_overrides + ["checkpoint.interval=3", "model.n_head=2"], arm="baseline")
    run_dir = train_arm(config, ParallelDims()).run_dir
    out = tmp_path / "delta_bias.md"
    proc = measure(run_dir, "--batches", 2, "--modes", "fa2/none", "fa2/fp32_output", "paper/none", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint" in proc.stderr and "[batch 2/2]" in proc.stderr  # progress
    rows = table_rows(proc.stdout, 7)
    assert {(r[0], r[1], r[2]) for r in rows} == {(str(i), str(h), m) for i in range(2) for h in range(2)
                                                  for m in ("fa2/none", "fa2/fp32_output", "paper/none")}
    by_mode = {m: [r for r in rows if r[2] == m] for m in ("fa2/none", "fa2/fp32_output")}
    rms_none = [float(r[4]) for r in by_mode["fa2/none"]]
    fp32 = [(float(r[3]), float(r[4])) for r in by_mode["fa2/fp32_output"]]
    assert min(rms_none) > 0, "fa2/none rounds O to bf16: its delta error cannot be identically 0"
    # The FP32 O drops the final cast's error; what is left is the bf16 P_bar operand of P_bar V, random and of the
    # same order on the diffuse attention of a 6-step model: smaller than fa2/none's in every head, without a bias
    # (|mean| within a few standard errors over 2 x 2 x 64 rows).
    assert all(rms < n for (_, rms), n in zip(fp32, rms_none)), (fp32, rms_none)
    assert all(abs(mean) < 5 * rms / 256**0.5 for mean, rms in fp32), fp32
    assert len(table_rows(proc.stdout, 4)) == 4  # tie rates per layer and head
    assert out.read_text().strip() == proc.stdout.strip()


def test_clear_errors_for_wrong_paths(tmp_path):
    missing = measure(tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    empty = measure(tmp_path)
    assert empty.returncode == 2 and "no complete checkpoint" in empty.stderr and "Traceback" not in empty.stderr
    stray = tmp_path / "notes.pt"
    stray.write_text("not a checkpoint")
    wrong = measure(stray)
    assert wrong.returncode == 2 and "is not a checkpoint" in wrong.stderr and "Traceback" not in wrong.stderr
