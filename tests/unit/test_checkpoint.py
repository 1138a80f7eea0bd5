"""Checkpoint files: format check, shape mismatches named with both shapes (in-process, CPU)."""

import errno
import os
import re

import pytest
import torch

from launcher.checkpoint import FORMAT, CheckpointError, CheckpointStore, check_fits
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


def _three_checkpoints(tmp_path) -> CheckpointStore:
    store = CheckpointStore(tmp_path)
    for step in (2, 4, 6):  # keep-2 leaves 4 and 6
        store.save(step, {"format": FORMAT, "step": step, "payload": torch.arange(1000.0) * step})
    assert [p.name for p in store.steps()] == ["step_00000004.pt", "step_00000006.pt"]
    return store


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda p: _truncate(p, p.stat().st_size // 2), r"truncated: \d+ of \d+ bytes"),
    (lambda p: _truncate(p, 0), r"empty: 0 of \d+ bytes"),
    (_flip_a_byte, "checksum mismatch"),
    (lambda p: p.with_name(p.name + ".sha256").unlink(), "no checksum file"),
    (lambda p: p.with_name(p.name + ".sha256").write_text("{not json"), "its checksum file is unreadable"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, reason):
    store = _three_checkpoints(tmp_path)
    newest = store.steps()[-1]
    assert store.problem(newest) is None
    damage(newest)
    assert store.problem(newest) is not None
    path, message = store.resumable()
    assert path.name == "step_00000004.pt" and store.load(path)["step"] == 4
    assert "\n" not in message  # one line, naming the bad file and why
    assert re.search(rf"{re.escape(str(newest))} is damaged \({reason}.*\); renamed to \*\.damaged, resuming "
                     r"from step_00000004.pt", message), message
    assert newest.with_name(newest.name + ".damaged").exists() and not newest.exists()
    assert store.resumable() == (path, None)  # the damaged file no longer shadows the good one


def test_no_intact_checkpoint_is_one_error_and_deletes_nothing(tmp_path):
    store = _three_checkpoints(tmp_path)
    for path in store.steps():
        _truncate(path, 10)
    with pytest.raises(CheckpointError, match=r"^no intact checkpoint to resume: .*step_00000006.pt is damaged "
                                              r"\(truncated: 10 of \d+ bytes\); .*step_00000004.pt is damaged .*"
                                              r"set checkpoint.resume=false run.overwrite=true to start over$"):
        store.resumable()
    assert len(list((tmp_path / "checkpoints").glob("*.damaged"))) == 2


def test_pruning_keeps_the_newest_intact_checkpoints_past_a_damaged_one(tmp_path):
    store = _three_checkpoints(tmp_path)
    _truncate(store.steps()[-1], 5)  # step 6 torn after it was written
    store.save(5, {"format": FORMAT, "step": 5})
    # keep-2 counts intact checkpoints only: 4 and 5 stay (a plain "two newest files" would have dropped 4)
    assert [p.name for p in store.steps()] == ["step_00000004.pt", "step_00000005.pt", "step_00000006.pt"]
    assert store.latest().name == "step_00000005.pt"
    assert store.resumable()[0].name == "step_00000005.pt"
    for step in (6, 7, 8):  # the run goes on: the damaged file stays for inspection until pruning passes its step
        store.save(step, {"format": FORMAT, "step": step})
        if step == 7:
            assert (tmp_path / "checkpoints" / "step_00000006.pt.damaged").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000007.pt", "step_00000007.pt.sha256", "step_00000008.pt", "step_00000008.pt.sha256"]


def test_an_unreadable_checkpoint_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "step_00000001.pt"
    path.write_bytes(b"this is not a zip file")
    with pytest.raises(CheckpointError, match=r"^checkpoint .*step_00000001.pt cannot be read \(.*\); move it away"):
        CheckpointStore(tmp_path).load(path)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    store = _three_checkpoints(tmp_path)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"^could not write checkpoint .*step_00000008.pt \(No space left on "
                                              r"device\); the previous checkpoints are intact"):
        store.save(8, {"format": FORMAT, "step": 8})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000004.pt", "step_00000004.pt.sha256", "step_00000006.pt", "step_00000006.pt.sha256"]
    assert store.resumable() == (store.steps()[-1], None)
