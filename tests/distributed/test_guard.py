"""The guard under data parallelism and ZeRO: a NaN or a loss spike on one rank drops the update on every rank, before
any parameter or Adam moment changes, exactly as with one process (CPU, gloo)."""

import pytest
import torch

from tests.runs import all_scalars, launch

pytestmark = pytest.mark.distributed

BAD_STEP = 3


@pytest.mark.parametrize("kind", ["nan", "spike"])
@pytest.mark.parametrize("nproc, overrides, bad_rank", [
    (2, ["parallel.zero_stage=2"], {"nan": 1, "spike": 1}),
    (2, ["parallel.zero_stage=3"], {"nan": 1, "spike": 1}),
    (2, ["parallel.tensor_parallel=2"], {"nan": 1, "spike": 1}),
    (2, ["parallel.pipeline_parallel=2"], {"nan": 0, "spike": 1}),  # NaN on the first stage, spike on the last
])
def test_a_bad_step_on_one_rank_is_dropped_everywhere(tiny_overrides, tmp_path, nproc, overrides, bad_rank, kind):
    common = ["smoke", "--arm", "baseline", *tiny_overrides, "model.n_head=2", "guard.action=skip",
              "guard.warmup_steps=2", "guard.loss_spike_factor=10", "run.max_steps=6", "optim.decay_steps=6",
              "data.global_batch_size=8"]  # 2 micro-batches per rank
    launch([kind, str(BAD_STEP), "0", *common, "run.experiment=single"], module="tests.distributed.nan_worker")
    launch([kind, str(BAD_STEP), str(bad_rank[kind]), *common, *overrides, "run.experiment=layout"], nproc,
           module="tests.distributed.nan_worker")
    single = all_scalars(tmp_path / "runs" / "single" / "baseline")
    layout = all_scalars(tmp_path / "runs" / "layout" / "baseline")
    assert layout["guard/bad_steps"] == single["guard/bad_steps"] == {BAD_STEP: 1.0}
    assert sorted(layout["train/loss"]) == sorted(single["train/loss"]) == [1, 2, 4, 5, 6]
    for step, value in single["train/loss"].items():  # the dropped step left the same state behind
        assert abs(layout["train/loss"][step] - value) <= 1e-4 * abs(value), (step, layout["train/loss"][step], value)
    # Adam counted 5 updates, not 6: the bad step never reached the optimizer (an update with zeroed gradients would
    # still count, and decay the moments)
    final = [torch.load(tmp_path / "runs" / e / "baseline" / "checkpoints" / "step_00000006.pt", map_location="cpu",
                        weights_only=False)["optimizer"] for e in ("single", "layout")]
    assert final[0]["adam_step"] == final[1]["adam_step"] == 5
    for name, moments in final[0]["state"].items():
        for key, value in moments.items():
            got = final[1]["state"][name][key]
            assert ((got - value).norm() / value.norm()).item() < 1e-2, (name, key)
