"""Data parallelism under torchrun (2 CPU processes, gloo): the same losses as one process with the same batch."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_train import scalars

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_two_process_ddp_matches_single_process(tiny_overrides, tmp_path):
    common = ["smoke", *tiny_overrides, "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2",
              "--arm", "baseline"]
    run([sys.executable, "-m", "launcher.pretrain", *common, "run.experiment=single"], tmp_path)
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               "-m", "launcher.pretrain", *common, "run.experiment=ddp"], tmp_path)
    assert "2 process(es)" in out
    single = scalars(tmp_path / "runs" / "single" / "baseline", "train/loss")
    ddp = scalars(tmp_path / "runs" / "ddp" / "baseline", "train/loss")
    assert sorted(single) == sorted(ddp) == list(range(1, 7))
    for step in single:  # same math, different reduction order
        assert abs(single[step] - ddp[step]) < 1e-4, (step, single[step], ddp[step])
