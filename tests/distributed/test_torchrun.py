"""Data parallelism under torchrun (2 CPU processes, gloo): the same losses as one process with the same batch."""

import pytest

from tests.runs import launch, scalars

pytestmark = pytest.mark.distributed


def test_two_process_ddp_matches_single_process(tiny_overrides, tmp_path):
    common = ["smoke", *tiny_overrides, "attention.backend=sdpa", "arms.baseline.attention.rounding=fa2",
              "--arm", "baseline"]
    launch([*common, "run.experiment=single"])
    out = launch([*common, "run.experiment=ddp"], nproc=2).stdout
    assert "2 process(es) = dp 2 x tp 1 x pp 1" in out
    single = scalars(tmp_path / "runs" / "single" / "baseline", "train/loss")
    ddp = scalars(tmp_path / "runs" / "ddp" / "baseline", "train/loss")
    assert sorted(single) == sorted(ddp) == list(range(1, 7))
    for step in single:  # same math, different reduction order
        assert abs(single[step] - ddp[step]) < 1e-4, (step, single[step], ddp[step])
