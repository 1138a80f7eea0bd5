"""Checkpoint files: format check, shape mismatches named with both shapes (in-process, CPU)."""

import pytest

from launcher.checkpoint import FORMAT, CheckpointStore, check_fits
from launcher.config import ConfigError
from launcher.parallel.dims import ParallelDims
from model import GPT, GPTConfig


def _state(model) -> dict:
    return {"format": FORMAT, "model": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_a_checkpoint_of_another_vocabulary_says_so(tmp_path):
    saved = GPT(GPTConfig(vocab_size=8192, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    here = GPT(GPTConfig(vocab_size=387, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    check_fits(_state(saved), saved, ParallelDims(), tmp_path / "ckpt.pt")  # fits itself
    with pytest.raises(ConfigError, match=r"tok_emb.weight is \(8192, 32\) there and \(387, 32\) here "
                                          r"\(vocabulary 8192 there, 387 here\)"):
        check_fits(_state(saved), here, ParallelDims(), tmp_path / "ckpt.pt")


def test_an_old_format_is_refused_with_what_to_do(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(3, {"step": 3, "model": {}, "optimizer": {}})  # format 1: state_dicts, no "format" key
    assert store.latest() == path
    with pytest.raises(ConfigError, match="older version .* start a new run.experiment or set checkpoint.resume=false"):
        store.load(path)
    assert store.load(store.save(4, {"format": FORMAT, "step": 4}))["step"] == 4
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.pt")) == ["step_00000003.pt",
                                                                                    "step_00000004.pt"]
