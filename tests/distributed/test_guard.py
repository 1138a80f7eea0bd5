"""The guard under data parallelism and ZeRO: a NaN or a loss spike on one rank drops the update on every rank, before
any parameter or Adam moment changes, exactly as with one process (CPU, gloo). Each run has both: a NaN at one step
and a spike at a later one (one launch per layout checks both)."""

import pytest

from launcher.checkpoint import read_whole_checkpoint
from tests.runs import all_scalars, launch

pytestmark = pytest.mark.distributed

NAN_STEP, SPIKE_STEP = 3, 5
MAX_STEPS = 7


@pytest.mark.parametrize("nproc, overrides, bad_rank", [
    (2, ["parallel.zero_stage=2"], {"nan": 1, "spike": 1}),
    (2, ["parallel.zero_stage=3"], {"nan": 1, "spike": 1}),
    (2, ["parallel.tensor_parallel=2"], {"nan": 1, "spike": 1}),
    (2, ["parallel.pipeline_parallel=2"], {"nan": 0, "spike": 1}),  # NaN on the first stage, spike on the last
])
def test_a_bad_step_on_one_rank_is_dropped_everywhere(tiny_overrides, tmp_path, nproc, overrides, bad_rank):
    common = ["smoke", "--arm", "baseline", *tiny_overrides, "model.n_head=2", "guard.action=skip",
              "guard.warmup_steps=2", "guard.loss_spike_factor=10", f"run.max_steps={MAX_STEPS}",
              f"optim.decay_steps={MAX_STEPS}", "data.global_batch_size=8"]  # 2 micro-batches per rank
    bad = ["nan,spike", f"{NAN_STEP},{SPIKE_STEP}"]
    launch([*bad, "0,0", *common, "run.experiment=single"], module="tests.distributed.nan_worker")
    launch([*bad, f"{bad_rank['nan']},{bad_rank['spike']}", *common, *overrides, "run.experiment=layout"], nproc,
           module="tests.distributed.nan_worker")
    single = all_scalars(tmp_path / "runs" / "single" / "baseline")
    layout = all_scalars(tmp_path / "runs" / "layout" / "baseline")
    assert layout["guard/bad_steps"] == single["guard/bad_steps"] == {NAN_STEP: 1.0, SPIKE_STEP: 2.0}  # a running count
    kept = [s for s in range(1, MAX_STEPS + 1) if s not in (NAN_STEP, SPIKE_STEP)]
    assert sorted(layout["train/loss"]) == sorted(single["train/loss"]) == kept
    for step, value in single["train/loss"].items():  # the dropped steps left the same state behind
        assert abs(layout["train/loss"][step] - value) <= 1e-4 * abs(value), (step, layout["train/loss"][step], value)
    # Adam counted 5 updates, not 7: neither bad step reached the optimizer (an update with zeroed gradients would
    # still count, and decay the moments)
    final = [read_whole_checkpoint(tmp_path / "runs" / e / "baseline" / "checkpoints" / f"step_{MAX_STEPS:08d}")
             ["optimizer"] for e in ("single", "layout")]
    assert final[0]["adam_step"] == final[1]["adam_step"] == len(kept) == 5
    for name, moments in final[0]["state"].items():
        for key, value in moments.items():
            got = final[1]["state"][name][key]
            assert ((got - value).norm() / value.norm()).item() < 1e-2, (name, key)
