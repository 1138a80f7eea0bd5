"""FP8 FFNs under every kind of layout, on the CPU: Transformer Engine replaced by tests/fake_transformer_engine.py,
which keeps TE's module interface and its amax collectives but not its FP8 arithmetic. What this proves: the fused
FFN holds the plain weights (one process with the fake matches the plain model), tensor, data (ZeRO) and pipeline
layouts train like one process with it, every rank joins every amax reduction (a rank that reduces alone hangs,
which fails the test by its timeout; the monitors' probe runs on some ranks only), and the FP8 scaling state is
saved and resumed. FP8 numerics and the real TE are covered by tests/gpu."""

import pytest
import torch

from launcher.checkpoint import read_whole_checkpoint
from tests.runs import all_scalars, launch

pytestmark = pytest.mark.distributed

STEPS, FIRST_LEG = 8, 4
WORKER = "tests.distributed.fake_fp8_worker"
TIMEOUT = 300  # seconds; each run takes ~15 s


@pytest.fixture(scope="module")
def setup(kjv_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8")
    common = ["smoke", "--arm", "fixed", "--no-report", f"data.data_dir={kjv_data}", f"run.out_dir={out}",
              "run.log_interval=1", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=64",
              "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=2", "optim.warmup_steps=2",
              f"optim.decay_steps={STEPS}", "eval.interval=4", "eval.batches=2", "monitor.spectral_interval=2",
              "monitor.probe_interval=2", f"checkpoint.interval={FIRST_LEG}", "precision.dtype=fp32",
              f"run.max_steps={STEPS}"]
    launch([*common, "run.experiment=plain"], timeout=TIMEOUT)
    launch([*common, "run.experiment=single", "precision.fp8_ffn=true"], module=WORKER, timeout=TIMEOUT)
    return out, common


def losses(out, experiment):
    return all_scalars(out / experiment / "fixed")["train/loss"]


def test_fused_ffn_trains_like_the_plain_model(setup):
    out, _ = setup
    plain, fused = losses(out, "plain"), losses(out, "single")
    assert sorted(fused) == list(range(1, STEPS + 1))
    for step, value in plain.items():
        assert abs(fused[step] - value) <= 1e-5 * value, (step, fused[step], value)
    state = read_whole_checkpoint(out / "single" / "fixed" / "checkpoints" / f"step_{STEPS:08d}")
    assert sorted(state["fp8_scaling"]) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert "blocks.1.ln2.weight" in state["model"] and "blocks.1.mlp.fc_in.weight" in state["model"]


@pytest.mark.parametrize("name, nproc, layout", [
    ("tp2", 2, ["parallel.tensor_parallel=2"]),
    ("tp2_sp", 2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),  # TE's sequence-parallel mode
    ("dp2", 2, []),
    ("dp2_zero1", 2, ["parallel.zero_stage=1"]),
    ("dp2_zero3", 2, ["parallel.zero_stage=3"]),
    ("pp2", 2, ["parallel.pipeline_parallel=2"]),
])
def test_layout_with_fp8_trains_like_one_process(setup, name, nproc, layout):
    out, common = setup
    launch([*common, *layout, f"run.experiment={name}", "precision.fp8_ffn=true", f"run.max_steps={FIRST_LEG}"],
           nproc=nproc, module=WORKER, timeout=TIMEOUT)
    launch([*common, *layout, f"run.experiment={name}", "precision.fp8_ffn=true"], nproc=nproc, module=WORKER,
           timeout=TIMEOUT)  # resumed from step 4, with the saved scaling state
    one, many = losses(out, "single"), losses(out, name)
    assert sorted(many) == list(range(1, STEPS + 1))
    for step, value in one.items():
        assert abs(many[step] - value) <= 1e-4 * value, (step, many[step], value)
    state = read_whole_checkpoint(out / name / "fixed" / "checkpoints" / f"step_{STEPS:08d}")
    single = read_whole_checkpoint(out / "single" / "fixed" / "checkpoints" / f"step_{STEPS:08d}")
    assert sorted(state["fp8_scaling"]) == ["blocks.0.mlp", "blocks.1.mlp"]  # every stage's
    # the history advances once per micro-batch forward: with as many micro-batches per rank as one process (tensor
    # and pipeline layouts) it is the single process's, up to the runs' small drift (losses within 1e-4; a value is a
    # maximum over the activations and moves more); a lost or misplaced history would be off by far more
    for module, tensors in single["fp8_scaling"].items() if not name.startswith("dp") else ():
        torch.testing.assert_close(state["fp8_scaling"][module]["amax_history_fwd"], tensors["amax_history_fwd"],
                                   rtol=5e-3, atol=1e-6)


def test_pipeline_with_activation_checkpointing_and_fp8_trains_the_fp8_modules(setup):
    """Pipeline + activation checkpointing + FP8 FFNs (the stateless recipes; validation refuses delayed with
    checkpointing). The FP8 FFNs must be swapped into the blocks before they are wrapped for recomputation, or the
    wrapper holds the FP8 modules while the wrapped blocks run (and train) the old ones (issue 20). Recomputation
    changes no arithmetic, so the run must equal the same pipeline without checkpointing bit for bit: losses,
    evaluation, and the monitors, which read the FFN weights from the FP8 modules (their spectral norms would stay
    at the initial weights' if those modules did not train). One stateless recipe is enough here: current and block
    take the same path through the launcher after make_recipe (no scaling state, nothing saved or loaded) and the fake
    TE treats every non-delayed recipe alike, so a block run would repeat this one; the FP8-before-checkpointing order
    is checked for both recipes by tests/unit/test_parallelize.py, and the real recipes on the GPU."""
    out, common = setup
    recipe = "current"
    layout = [*common, "parallel.pipeline_parallel=2", "precision.fp8_ffn=true", f"precision.fp8_recipe={recipe}"]
    launch([*layout, f"run.experiment=pp2_{recipe}"], nproc=2, module=WORKER, timeout=TIMEOUT)
    launch([*layout, "parallel.activation_checkpointing=true", f"run.experiment=pp2_{recipe}_checkpointed"], nproc=2,
           module=WORKER, timeout=TIMEOUT)
    plain = all_scalars(out / f"pp2_{recipe}" / "fixed")
    checkpointed = all_scalars(out / f"pp2_{recipe}_checkpointed" / "fixed")
    assert sorted(checkpointed["train/loss"]) == list(range(1, STEPS + 1))
    assert any(t.startswith("spectral/") and t.endswith("/fc_in") for t in plain)
    for tag, series in plain.items():
        if not tag.startswith(("perf/", "monitor/")):  # timings
            assert checkpointed[tag] == series, tag
