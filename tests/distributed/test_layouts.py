"""Every layout reproduces the single-process run (CPU, gloo, torchrun workers): tensor parallel 2, pipeline parallel
2, tensor x pipeline 2 x 2, data parallel 2 under ZeRO 1, 2 and 3, tensor x data parallel 2 x 2 (DDP and ZeRO-2), and
sequence parallelism with tensor parallel 2 and with tensor x pipeline 2 x 2 (activation checkpointing), each with
gradient accumulation (2 micro-batches per rank and step, 4 with one process or a pipeline of one data
rank).

The smoke model shrunk to seconds, FP32, the fixed arm (paper rounding with the safe dynamic_max fix, whose per-row
shift depends on the global head index). Each layout trains steps 1-6, stops, and resumes to step 10 from its own
checkpoint (the layouts checked for exact resumption: from their uninterrupted run's step-6 checkpoint, written
after the same steps and evaluations); its losses, evaluation and monitor values must match one process's
uninterrupted run. Checkpoints are
also resumed under another layout (with and without sequence parallelism), and resuming within a layout is exact."""

import shutil

import pytest
import torch

from launcher.checkpoint import read_whole_checkpoint
from tests.runs import REPO, all_scalars, launch

pytestmark = pytest.mark.distributed

STEPS, FIRST_LEG = 10, 6
LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, ["parallel.tensor_parallel=2"]),
    "pp2": (2, ["parallel.pipeline_parallel=2"]),
    "tp2_pp2": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"]),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "dp2_zero2": (2, ["parallel.zero_stage=2"]),
    "dp2_zero3": (2, ["parallel.zero_stage=3"]),
    "tp2_dp2": (4, ["parallel.tensor_parallel=2"]),
    "tp2_dp2_zero2": (4, ["parallel.tensor_parallel=2", "parallel.zero_stage=2"]),
    # sequence parallelism; the pipeline one also recomputes its blocks (activation checkpointing) and overlaps the
    # input-gradient reduce-scatter of the MLP and the output layer with their weight gradient
    "tp2_sp": (2, ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]),
    "tp2_pp2_sp": (4, ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.sequence_parallel=true",
                       "parallel.activation_checkpointing=true", "parallel.tp_async_grad_reduce=true"]),
}
EXACT_RESUME = ("dp2_zero3", "tp2_dp2_zero2", "pp2")  # also trained without interruption, to compare bit for bit


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def common(kjv_data, out_dir) -> list[str]:
    # the safe dynamic_max fix: its per-row shift hashes the global head index, which every layout must keep
    return ["smoke", "--arm", "fixed", "arms.fixed.attention.fix=dynamic_max", "--no-report",
            f"data.data_dir={kjv_data}", f"run.out_dir={out_dir}",
            "run.log_interval=1", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=64",
            "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=2", "optim.warmup_steps=2",
            f"optim.decay_steps={STEPS}", "eval.interval=3", "eval.batches=2", "monitor.spectral_interval=5",
            "monitor.probe_interval=5", f"checkpoint.interval={FIRST_LEG}", "precision.dtype=fp32"]


def run_dir(out_dir, experiment):
    return out_dir / experiment / "fixed"


@pytest.fixture(scope="module")
def reference(common, out_dir):
    """One process, uninterrupted, checkpoints at steps 6 and 10."""
    launch([*common, "run.experiment=single", f"run.max_steps={STEPS}"])
    return all_scalars(run_dir(out_dir, "single"))


@pytest.fixture(scope="module")
def layout_run(common, out_dir):
    """layout_run(name) -> (scalars of the run interrupted at step 6 and resumed, scalars of an uninterrupted run or
    None); each layout is trained once per module, by the first test that asks for it."""
    done = {}

    def run(name):
        if name not in done:
            nproc, overrides = LAYOUTS[name]
            args = [*common, *overrides, f"run.experiment={name}"]
            straight = None
            if name in EXACT_RESUME:
                # the uninterrupted run's step-6 checkpoint (saved right after the step-6 evaluation, as a first leg
                # stopping at step 6 saves it: the two are the same state) is the interrupted run's first leg; one
                # launch fewer
                launch([*common, *overrides, f"run.experiment={name}_straight", f"run.max_steps={STEPS}"], nproc)
                straight = all_scalars(run_dir(out_dir, f"{name}_straight"))
                first_leg = run_dir(out_dir, f"{name}_straight") / "checkpoints" / f"step_{FIRST_LEG:08d}"
                shutil.copytree(first_leg, run_dir(out_dir, name) / "checkpoints" / first_leg.name)
            else:
                launch([*args, f"run.max_steps={FIRST_LEG}"], nproc)
            out = launch([*args, f"run.max_steps={STEPS}"], nproc).stdout
            assert "resumed from" in out and f"at step {FIRST_LEG}" in out
            resumed = all_scalars(run_dir(out_dir, name))
            if straight is not None:  # the first leg's steps are the uninterrupted run's
                assert all(step > FIRST_LEG for series in resumed.values() for step in series), resumed
                resumed = {tag: {**{s: v for s, v in straight.get(tag, {}).items() if s <= FIRST_LEG},
                                 **resumed.get(tag, {})} for tag in set(straight) | set(resumed)}
            done[name] = resumed, straight
        return done[name]

    return run


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def agrees(tag: str, a: float, b: float, pipeline: bool = False) -> bool:
    """Whether a layout's value of ``tag`` agrees with one process's, given that the layouts' weights differ from it by
    rounding (all-reduce order) only."""
    if tag == "train/grad_norm" and pipeline:
        # DeepSpeed's ZeRO-1 norm under its pipeline engine counts ~0.02 of extra gradient norm on the last stage
        # (the true norm, summed by hand over the stages, equals one process's): up to 5e-4 after 10 steps
        return close(a, b, 1e-3)
    if tag.startswith(("train/", "eval/")):
        return close(a, b, 1e-4)
    # spectra of the Q-K update between steps 5 and 10 and of the probe scores (measured exactly on identical weights
    # by initial_weights_worker.py). The update is five Adam steps, in which the layouts' last-bit gradient
    # differences become lr-sized (above): its norms differ by a few percent, its stable ranks (a ratio to the top
    # singular value squared) by more (seen: up to 1.6% and 6.8%, srank2 under TP2 + SP; with the per-parameter seeded
    # initialisation 0.8% and 11%, srank2 under TP2 x DP2 ZeRO-2); normalised entropies lie in [0, 1] and near 0 (one
    # dominant direction) are set by tail singular values of rounding size, so they get an absolute tolerance (seen:
    # up to 0.003)
    if tag.startswith(("qk_update/", "qk_act/")):
        return abs(a - b) <= 0.01 if "entropy" in tag else close(a, b, 0.2 if "srank" in tag else 0.1)
    if tag.startswith(("spectral/", "act/")) or tag.endswith("entropy"):
        return close(a, b, 1e-2)
    # Adam amplifies the last-bit differences of near-zero gradient entries into lr-sized weight differences, which
    # the maximum of BF16-rounded scores follows loosely
    if tag.endswith("max_logit"):
        return close(a, b, 0.1)
    # A tie rate counts rows whose top two scores lie within eps: a step function of the weights. Weights that differ
    # by rounding can move any number of near-tied rows across eps (seen: 0.297 vs 0.422 under ZeRO-3 at step 5), so
    # no tolerance follows from the arithmetic here. What a layout must keep equal, the statistic computed on the same
    # weights, is checked exactly for every layout on identical weights (initial_weights_worker.py); here only its
    # range is.
    if tag.endswith("tie_rate"):
        return 0.0 <= a <= 1.0
    # The early warning is a flag raised by a tie rate or a W_Q growth crossing a threshold: the same step function,
    # so only its values are checked; its growth ratio is a ratio of spectral norms
    if tag == "warning/on":
        return a in (0.0, 1.0)
    if tag in ("warning/wq_growth", "warning/wq_relative"):
        return close(a, b, 1e-2)
    if tag == "warning/delta_persistence":  # of delta-bias sums, which are rounding noise here (below)
        return 0.0 <= a <= 1.0
    # delta-bias sums and cosines are sums of last-bit rounding errors: their values are noise at this scale; only
    # the tags must match
    return tag.startswith("delta_bias/")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, layout_run, name):
    got, _ = layout_run(name)
    assert set(got) == set(reference), f"{name}: tags differ: {set(got) ^ set(reference)}"
    assert sorted(got["train/loss"]) == list(range(1, STEPS + 1))
    for tag, series in reference.items():
        if tag.startswith(("perf/", "monitor/")):
            continue  # timings
        assert set(series) <= set(got[tag]), (name, tag)  # (the first leg also evaluates at its last step, 6)
        for step, value in series.items():
            assert agrees(tag, got[tag][step], value, pipeline="pp" in name), (name, tag, step, got[tag][step], value)


def test_sequence_parallel_equals_tensor_parallel(layout_run):
    """Sequence parallelism moves where the LayerNorms, residuals and dropout run, not what they compute: its losses
    are TP2's up to the order of a few sums (LayerNorm gradients summed per rank, then over the ranks)."""
    sp, _ = layout_run("tp2_sp")
    tp, _ = layout_run("tp2")
    for tag in ("train/loss", "eval/loss"):
        assert set(sp[tag]) == set(tp[tag])
        for step, value in tp[tag].items():
            assert close(sp[tag][step], value, 1e-6), (tag, step, sp[tag][step], value)


@pytest.mark.parametrize("name", EXACT_RESUME)
def test_resume_within_a_layout_is_exact(layout_run, name):
    resumed, straight = layout_run(name)
    assert resumed["train/loss"] == straight["train/loss"]
    assert {step: resumed["eval/loss"][step] for step in straight["eval/loss"]} == straight["eval/loss"]


def _adam_moments(path):
    return read_whole_checkpoint(path)["optimizer"]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# (that every layout loads a checkpoint of ZeRO-3 or TP2 x PP2 bit for bit: test_sharded_checkpoints.py)
@pytest.mark.parametrize("source, target", [("tp2_dp2_zero2", "single"), ("tp2_sp", "single"), ("tp2", "tp2_sp")])
def test_resume_under_another_layout(reference, layout_run, common, out_dir, source, target):
    """A step-6 checkpoint of one layout resumed under another reaches the same step-10 losses and Adam state."""
    if source in LAYOUTS:
        layout_run(source)  # its checkpoints
    experiment = f"{source}_to_{target}"
    source_ckpt = run_dir(out_dir, source) / "checkpoints" / f"step_{FIRST_LEG:08d}"
    shutil.copytree(source_ckpt, run_dir(out_dir, experiment) / "checkpoints" / source_ckpt.name)
    nproc, overrides = (1, []) if target == "single" else LAYOUTS[target]
    out = launch([*common, *overrides, f"run.experiment={experiment}", f"run.max_steps={STEPS}"], nproc).stdout
    assert f"at step {FIRST_LEG}" in out
    losses = all_scalars(run_dir(out_dir, experiment))["train/loss"]
    assert sorted(losses) == list(range(FIRST_LEG + 1, STEPS + 1))
    for step, value in losses.items():
        assert close(value, reference["train/loss"][step], 1e-4), (step, value, reference["train/loss"][step])
    final = f"step_{STEPS:08d}"
    mine = _adam_moments(run_dir(out_dir, experiment) / "checkpoints" / final)
    ref = _adam_moments(run_dir(out_dir, "single") / "checkpoints" / final)
    assert mine["adam_step"] == ref["adam_step"] == STEPS
    # Adam's moments after 4 more steps agree to a few percent at most (the gradients differ in their last bits, which
    # Adam's normalised updates amplify); had the step-6 moments been lost, beta1^4 = 66% of the first moment would be
    # missing
    for name, moments in ref["state"].items():
        for key, value in moments.items():
            assert relative_error(mine["state"][name][key], value) < 0.1, (name, key)


def test_initial_weights_and_monitors_match_the_single_process_model(tmp_path):
    out = launch([str(tmp_path)], nproc=4, module="tests.distributed.initial_weights_worker").stdout
    for layout in ("tp=1 x dp=4", "tp=2 x dp=2", "tp=4 x dp=1", "tp=1 x dp=4 zero3", "tp=1 x dp=2 x pp=2",
                   "tp=2 x dp=1 x pp=2", "tp=2 x dp=2 sp", "tp=2 x dp=2 zero3 sp", "tp=2 x dp=1 x pp=2 sp"):
        assert f"{layout}: each rank materialised its share only" in out, out
        assert f"{layout}: initial weights identical" in out, out
        assert f"{layout}: monitors agree" in out, out


@pytest.mark.parametrize("nproc, overrides, message", [
    (3, ["parallel.tensor_parallel=2"], "3 process(es) cannot be split into tensor_parallel=2"),
    (2, ["data.global_batch_size=6", "data.micro_batch_size=2"], "for example set data.micro_batch_size=1"),
])
def test_impossible_layouts_fail_before_any_work_with_one_message(common, out_dir, nproc, overrides, message):
    proc = launch([*common, *overrides, "run.experiment=impossible", "run.max_steps=2"], nproc, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count(message) == 1, out[-3000:]
    for package in ("launcher", "analysis", "model", "kernels"):  # no traceback through our code (torchrun: its own)
        assert f'File "{REPO / package}' not in out, out[-3000:]
    assert not (out_dir / "impossible").exists()
