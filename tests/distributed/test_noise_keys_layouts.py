"""Attention that draws random bits (random delta signs at delta_gain 20, fix=stochastic_output) trains the same under
tensor parallel 2, pipeline parallel 2 and data parallel 2 (ZeRO-1, DDP) as in one process, and resumes exactly.

The row keys are what makes this work: a hash of (run seed, step, global batch row), mixed with the global layer index
before the attention (launcher/data.py, model/attention.py). Losses alone cannot show that the keys are routed right:
at these sizes random signs move the loss by ~1e-6, below the layouts' rounding differences. So each run also records
the noise keys every layer's attention received (tests/distributed/noise_keys_worker.py), and the union over the ranks
must equal one process's exactly. The smoke model shrunk to seconds, FP32 (the reference rounds attention inputs to
BF16), 4 steps of 2 micro-batches per rank (4 in one process)."""

import json

import pytest

from tests.runs import all_scalars, launch

pytestmark = pytest.mark.distributed

STEPS = 4
VARIANTS = {  # name: overrides of the smoke recipe's fixed arm (paper rounding, dynamic_max)
    "random": ["attention.delta_gain=20", "attention.delta_sign=random"],
    "sr": ["arms.fixed.attention.fix=stochastic_output"],
}
LAYOUTS = {  # name: (processes, overrides)
    "tp2": (2, ["parallel.tensor_parallel=2"]),
    "pp2": (2, ["parallel.pipeline_parallel=2"]),
    "dp2_zero1": (2, ["parallel.zero_stage=1"]),
    "dp2_ddp": (2, []),
}
# the key plumbing is the same for both variants: each engine once (DeepSpeed's pipeline, ZeRO, DDP), TP for both (the
# global head index enters the hashes)
CASES = [("random", "tp2"), ("random", "pp2"), ("random", "dp2_zero1"), ("sr", "tp2"), ("sr", "dp2_ddp")]
WORKER = "tests.distributed.noise_keys_worker"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("noise_keys")


@pytest.fixture(scope="module")
def common(kjv_data, out_dir) -> list[str]:
    return ["smoke", "--arm", "fixed", "--no-report", f"data.data_dir={kjv_data}", f"run.out_dir={out_dir}",
            "run.log_interval=1", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=64",
            "data.seq_len=64", "data.global_batch_size=8", "data.micro_batch_size=2", "optim.warmup_steps=2",
            f"optim.decay_steps={STEPS}", "eval.interval=2", "eval.batches=2", "monitor.spectral_interval=0",
            "monitor.probe_interval=2", "checkpoint.interval=2", "precision.dtype=fp32"]


def train(common, out_dir, variant, experiment, nproc=1, overrides=(), max_steps=STEPS):
    """Train; returns (scalars, {layer: set of noise keys its attention got, over all ranks})."""
    record = out_dir / f"{experiment}.keys"
    for old in out_dir.glob(f"{record.name}.*.json"):  # a resumed run records its second leg only
        old.unlink()
    launch([str(record), *common, *VARIANTS[variant], *overrides, f"run.experiment={experiment}",
            f"run.max_steps={max_steps}"], nproc, module=WORKER)
    keys: dict[int, set[int]] = {}
    for path in out_dir.glob(f"{record.name}.*.json"):
        for layer, values in json.loads(path.read_text()).items():
            keys.setdefault(int(layer), set()).update(values)
    return all_scalars(out_dir / experiment / "fixed"), keys


@pytest.fixture(scope="module")
def single(common, out_dir):
    """One process, uninterrupted, per variant (trained once per module)."""
    done = {}

    def run(variant):
        if variant not in done:
            done[variant] = train(common, out_dir, variant, f"single_{variant}")
        return done[variant]

    return run


def close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("variant, layout", CASES)
def test_layout_matches_single_process(single, common, out_dir, variant, layout):
    reference, reference_keys = single(variant)
    nproc, overrides = LAYOUTS[layout]
    got, keys = train(common, out_dir, variant, f"{variant}_{layout}", nproc, overrides)
    # every layer got the same keys as in one process: the training rows' (8 per step) and evaluation's key 0
    assert keys == reference_keys, (variant, layout)
    assert set(reference_keys) == {0, 1} and reference_keys[0] != reference_keys[1]
    assert all(len(k) == STEPS * 8 + 1 for k in reference_keys.values()), {i: len(k) for i, k in keys.items()}
    assert sorted(got["train/loss"]) == list(range(1, STEPS + 1))
    for tag in ("train/loss", "eval/loss"):  # the tolerance of tests/distributed/test_layouts.py for FP32 steps
        for step, value in reference[tag].items():
            assert close(got[tag][step], value, 1e-4), (variant, layout, tag, step, got[tag][step], value)
    assert set(got) == set(reference)  # the monitors (delta bias with the probe's fixed key) ran on every layout


def test_random_signs_resume_exactly(single, common, out_dir):
    """Stopped at step 2 and resumed, a random-sign run draws the same signs as uninterrupted: identical losses."""
    straight, _ = single("random")
    train(common, out_dir, "random", "resumed_random", max_steps=2)
    resumed, _ = train(common, out_dir, "random", "resumed_random")
    assert resumed["train/loss"] == straight["train/loss"]
    assert resumed["eval/loss"] == straight["eval/loss"]

