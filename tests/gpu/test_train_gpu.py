"""The trainer on a CUDA GPU: both arms with the Triton kernel under BF16 autocast, and FP8 FFNs through TE."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import FIXES, ROUNDINGS
from launcher.checkpoint import read_whole_checkpoint
from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.trainer import train_arm
from tests.runs import scalars

pytestmark = pytest.mark.gpu

needs_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                              reason="transformer_engine is not installed (on a GPU machine: pip install -e '.[gpu]')")

REPO = Path(__file__).resolve().parents[2]

GPU_OVERRIDES = ["run.device=cuda", "model.d_model=128", "model.n_head=2", "model.max_seq_len=128",
                 "data.seq_len=128", "run.max_steps=30", "optim.decay_steps=30", "monitor.spectral_interval=10",
                 "monitor.probe_interval=10"]


@pytest.mark.parametrize("arm", ["baseline", "fixed"])
def test_arm_trains_with_triton_kernel(tiny_overrides, arm):
    config = load_config("smoke", tiny_overrides + GPU_OVERRIDES, arm=arm)
    result = train_arm(config, ParallelDims(device=torch.device("cuda", 0)))
    losses = scalars(result.run_dir, "train/loss")
    assert result.status == "completed" and len(losses) == 30
    assert losses[30] < losses[1] - 0.5
    assert scalars(result.run_dir, "perf/mfu")  # H100/H200 peak is known
    assert scalars(result.run_dir, "delta_bias/L01/h00/cum")  # the monitors ran against the Triton backend


@pytest.mark.parametrize("fix", FIXES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_compiled_trainer_trains_like_eager_with_triton_kernel(tiny_overrides, rounding, fix):
    """run.compile=true with the Triton kernel in every mode: the custom op's fake kernels give inductor the real
    output shapes and strides, and the compiled steps follow the eager ones."""
    losses = {}
    for compiled in ("false", "true"):
        config = load_config("smoke", tiny_overrides + GPU_OVERRIDES + [
            f"arms.fixed.attention.rounding={rounding}", f"arms.fixed.attention.fix={fix}", f"run.compile={compiled}",
            "run.max_steps=8", "optim.decay_steps=8", "monitor.spectral_interval=0", "monitor.probe_interval=0",
            "eval.interval=0", f"run.experiment=compile_{compiled}"], arm="fixed")
        result = train_arm(config, ParallelDims(device=torch.device("cuda", 0)))
        assert result.status == "completed"
        losses[compiled] = scalars(result.run_dir, "train/loss")
    eager, compiled = losses["false"], losses["true"]
    assert sorted(compiled) == list(range(1, 9))
    for step in range(1, 9):  # inductor fuses the surrounding BF16 ops differently: a fraction of a per cent
        assert abs(compiled[step] - eager[step]) <= 1e-2 * eager[step], (step, compiled[step], eager[step])


@needs_te
@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_fp8_ffn_trains_like_bf16(tiny_overrides, recipe):
    runs = {}
    for fp8 in ("false", "true"):
        config = load_config("smoke", tiny_overrides + GPU_OVERRIDES + [
            f"precision.fp8_ffn={fp8}", f"precision.fp8_recipe={recipe}", f"run.experiment={recipe}_{fp8}"],
            arm="fixed")
        result = train_arm(config, ParallelDims(device=torch.device("cuda", 0)))
        assert result.status == "completed"
        runs[fp8] = scalars(result.run_dir, "train/loss")
    fp8, bf16 = runs["true"], runs["false"]
    assert fp8[30] < fp8[1] - 0.5
    for step in range(1, 6):  # from the same weights, FP8 FFNs change the loss by a fraction of a per cent
        assert abs(fp8[step] - bf16[step]) <= 1e-2 * bf16[step], (step, fp8[step], bf16[step])
    # later single steps part ways (this tiny model's high learning rate makes spikes); the trend does not
    late = range(21, 31)
    assert abs(sum(fp8[s] for s in late) - sum(bf16[s] for s in late)) <= 5e-2 * sum(bf16[s] for s in late)


@needs_te
def test_fused_fp8_ffn_holds_the_plain_weights(seed):
    """The fused LayerNorm + MLP computes the plain block's ``mlp(ln2(x))`` (FP32 when FP8 is off, within FP8's
    error when on), and reports its parameters under the plain model's names."""
    from launcher.fp8 import FP8FeedForward, apply_fp8_ffn
    from launcher.parallel.names import named_parameters
    from model import GPT, GPTConfig

    dims = ParallelDims(device=torch.device("cuda", 0))
    config = load_config("smoke", []).precision
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=64, bias=True)).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-trivial LayerNorm gains and biases
    plain = {n: p.detach().clone() for n, p in named_parameters(model)}
    x = torch.randn(4, 32, 64, device="cuda")
    block = model.blocks[1]
    expected = block.mlp(block.ln2(x))
    assert apply_fp8_ffn(model.blocks, config, dims) == 2
    assert isinstance(model.blocks[1].mlp, FP8FeedForward) and isinstance(model.blocks[1].attn.q_proj, torch.nn.Linear)
    fused = {n: p.detach() for n, p in named_parameters(model)}
    assert sorted(fused) == sorted(plain)
    assert all(torch.equal(fused[n], plain[n]) for n in plain)
    block.mlp.fp8 = False
    # TE's FP32 GEMMs may use TF32 (10-bit mantissa): ~1e-3 relative; a wrong weight would be O(1)
    err = (block.mlp(block.ln2(x)) - expected).norm() / expected.norm()
    assert err < 3e-3, err
    block.mlp.fp8 = True
    err = (block.mlp(block.ln2(x)) - expected).norm() / expected.norm()
    assert 0 < err < 0.1, err


@needs_te
def test_fp8_scaling_state_resumes(tiny_overrides):
    """Delayed scaling's amax history and scales are saved with the checkpoint and installed on resume; the
    resumed run continues with the losses of the uninterrupted one."""
    common = tiny_overrides + GPU_OVERRIDES + ["precision.fp8_ffn=true", "run.max_steps=20", "optim.decay_steps=20",
                                               "checkpoint.interval=10", "monitor.spectral_interval=0",
                                               "monitor.probe_interval=0"]
    full = train_arm(load_config("smoke", common + ["run.experiment=full"], arm="fixed"),
                     ParallelDims(device=torch.device("cuda", 0)))
    state = read_whole_checkpoint(full.run_dir / "checkpoints" / "step_00000010")
    history = state["fp8_scaling"]["blocks.1.mlp"]["amax_history_fwd"]
    assert history.shape[0] == 16 and history.abs().sum() > 0
    first = train_arm(load_config("smoke", common + ["run.experiment=cut", "run.max_steps=10"], arm="fixed"),
                      ParallelDims(device=torch.device("cuda", 0)))
    assert first.status == "completed"
    resumed = train_arm(load_config("smoke", common + ["run.experiment=cut"], arm="fixed"),
                        ParallelDims(device=torch.device("cuda", 0)))
    a, b = scalars(full.run_dir, "train/loss"), scalars(resumed.run_dir, "train/loss")
    assert sorted(b) == list(range(1, 21))
    for step in range(11, 21):
        assert abs(a[step] - b[step]) <= 1e-3 * abs(a[step]), (step, a[step], b[step])


def test_resume_in_a_new_process_is_bit_exact_with_autotuned_tiles(tiny_overrides, tmp_path):
    """A checkpoint of step 4, resumed in a new process, trains steps 5-8 on the tiles the first process autotuned
    (installed from the checkpoint, not timed again: the tile is part of the numerics) and reproduces that process's
    own steps 5-8 bit for bit. (Two processes that each tune from scratch may choose differently, so the reference is
    the process that wrote the checkpoint.)"""
    common = tiny_overrides + GPU_OVERRIDES + ["run.max_steps=8", "optim.decay_steps=8", "monitor.spectral_interval=0",
                                               "monitor.probe_interval=0", "eval.interval=0", "checkpoint.interval=4"]

    def run(*extra):
        done = subprocess.run([sys.executable, "-m", "launcher.pretrain", "smoke", *common, *extra, "--arm", "fixed",
                               "--no-report"], cwd=REPO, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    run("run.experiment=full")
    full = tmp_path / "runs" / "full" / "fixed"
    step4 = full / "checkpoints" / "step_00000004"
    assert read_whole_checkpoint(step4)["kernel_tuning"]["choices"]  # the first process's choices are in it
    resumed = tmp_path / "runs" / "resumed" / "fixed"
    shutil.copytree(step4, resumed / "checkpoints" / step4.name)
    assert "recorded attention-kernel tile choice(s)" in run("run.experiment=resumed")
    a, b = scalars(full, "train/loss"), scalars(resumed, "train/loss")
    assert sorted(b) == [5, 6, 7, 8]
    assert {step: a[step] for step in b} == b
