"""The trainer on a CUDA GPU: both arms with the Triton kernel under BF16 autocast, and FP8 FFNs through TE."""

import importlib.util

import pytest
import torch

from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.trainer import train_arm
from tests.runs import scalars

pytestmark = pytest.mark.gpu

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


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="transformer_engine is not installed (on a GPU machine: pip install -e '.[gpu]')")
def test_fp8_ffn_trains(tiny_overrides):
    config = load_config("smoke", tiny_overrides + GPU_OVERRIDES + ["precision.fp8_ffn=true"], arm="fixed")
    result = train_arm(config, ParallelDims(device=torch.device("cuda", 0)))
    losses = scalars(result.run_dir, "train/loss")
    assert result.status == "completed"
    assert losses[30] < losses[1] - 0.5


def test_fp8_swaps_only_ffn_matrices():
    te = pytest.importorskip("transformer_engine.pytorch")
    from launcher.fp8 import apply_fp8_ffn
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, max_seq_len=32, n_layer=2, n_head=2, d_model=64)).cuda()
    before = model.blocks[0].mlp.fc_in.weight.detach().clone()
    assert apply_fp8_ffn(model, torch.device("cuda", 0)) == 4
    assert isinstance(model.blocks[1].mlp.fc_out, te.Linear)
    assert isinstance(model.blocks[1].attn.q_proj, torch.nn.Linear)
    assert torch.equal(model.blocks[0].mlp.fc_in.weight.detach(), before)
