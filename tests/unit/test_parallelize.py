"""launcher/parallelize.py on one process: the fixed order of the layout's steps, seen on the model it returns."""

import subprocess
import sys

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from launcher import fp8
from launcher.config import load_config
from launcher.parallel.dims import ParallelDims
from launcher.parallel.names import named_parameters
from launcher.parallelize import parallelize
from launcher.trainer import build_model
from model.gpt import CausalSelfAttention
from tests import fake_transformer_engine
from tests.runs import REPO

TINY = ["model.vocab_size=256", "model.n_layer=2", "model.d_model=64", "model.n_head=2", "model.max_seq_len=32",
        "data.seq_len=32", "data.global_batch_size=4", "data.micro_batch_size=2", "precision.dtype=fp32"]


@pytest.fixture
def fake_te(monkeypatch):
    """tests/fake_transformer_engine.py as Transformer Engine for this test only."""
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common",
                 "transformer_engine.common.recipe"):
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
    fake_transformer_engine.install()
    monkeypatch.setattr(fp8, "require_gpu", lambda device: None)


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_fp8_ffns_are_inside_the_checkpointed_blocks(fake_te, recipe):
    """FP8 before activation checkpointing: the wrapper recomputes the block that runs the FP8 FFN, and every
    parameter keeps its plain name and receives a gradient."""
    config = load_config("smoke", [*TINY, "precision.fp8_ffn=true", f"precision.fp8_recipe={recipe}",
                                   "parallel.activation_checkpointing=true"])
    model, _, _ = build_model(config)
    plain_names = [n for n, _ in named_parameters(model)]
    part = parallelize(model, config, ParallelDims())
    for block in part.blocks:
        assert isinstance(block, CheckpointWrapper)
        assert isinstance(block._checkpoint_wrapped_module.mlp, fp8.FP8FeedForward)
    assert sorted(n for n, _ in named_parameters(part)) == sorted(plain_names)
    ids = torch.randint(0, 256, (2, 32))
    _, loss = part(ids, ids)
    loss.backward()
    assert all(p.grad is not None for p in part.parameters())


def test_zero3_calls_the_projections_as_modules():
    config = load_config("smoke", [*TINY, "parallel.zero_stage=3"])
    part = parallelize(build_model(config)[0], config, ParallelDims())
    assert not any(m.fused_qkv for m in part.modules() if isinstance(m, CausalSelfAttention))


def test_tag_names_load_without_fp8_parallel_or_torch_distributed():
    """The comparison and the metrics import the tag names alone (launcher/monitors/tags.py)."""
    check = ("import sys, launcher.compare, launcher.metrics; "
             "print(sorted(m for m in sys.modules if m.startswith(('launcher.fp8', 'launcher.parallel', "
             "'torch.distributed'))))")
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
