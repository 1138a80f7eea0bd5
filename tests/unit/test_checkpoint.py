"""Checkpoint folders on one process: damage detection and fallback, pruning, a full disk, shape mismatches named with
both shapes, earlier single-file checkpoints refused with the command that converts them (and the conversion)."""

import errno
import hashlib
import json
import os
import re

import pytest
import torch

from launcher.checkpoint import (FORMAT, RUN, CheckpointError, CheckpointStore, check_fits, convert,
                                 read_whole_checkpoint, rng_state)
from launcher.config import ConfigError
from launcher.sharded import Sharded, flat_range_chunks, saved_shapes
from model import GPT, GPTConfig


def _entries(step: int) -> dict:
    payload = torch.arange(1000.0) * step
    return {RUN: {"format": FORMAT, "step": step}, "payload": Sharded((1000,), [((0,), payload)])}


def _three_checkpoints(tmp_path) -> CheckpointStore:
    store = CheckpointStore(tmp_path)
    for step in (2, 4, 6):  # keep-2 leaves 4 and 6
        store.save(step, _entries(step))
    assert [p.name for p in store.steps()] == ["step_00000004", "step_00000006"]
    return store


def _shard(path):
    return path / "__0_0.distcp"


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_is_a_folder_of_shards_with_its_checksums(tmp_path):
    store = _three_checkpoints(tmp_path)
    newest = store.latest()
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "__0_0.distcp", "checksums.json"]
    assert store.problem(newest) is None and not list(store.dir.glob("*.tmp"))
    assert store.run_state(newest)["step"] == 6
    assert torch.equal(store.read(newest, {"payload": Sharded((1000,), [((0,), torch.zeros(1000))])})["payload"]
                       .chunks[0][1], torch.arange(1000.0) * 6)


def test_flat_ranges_become_rectangles():
    """A ZeRO partition is a range of the flattened tensor: its rectangles cover exactly that range."""
    full = torch.arange(35.0).view(5, 7)
    for start, end in [(0, 35), (0, 3), (3, 20), (20, 35), (8, 9), (7, 28), (6, 8)]:
        chunks = flat_range_chunks((5, 7), start, full.flatten()[start:end])
        assert len(chunks) <= 3
        covered = torch.zeros(5, 7, dtype=torch.bool)
        for (row, col), tensor in chunks:
            rows, cols = tensor.shape
            assert torch.equal(tensor, full[row:row + rows, col:col + cols])
            covered[row:row + rows, col:col + cols] = True
        assert covered.flatten().nonzero().flatten().tolist() == list(range(start, end))


def test_a_checkpoint_of_another_vocabulary_says_so(tmp_path):
    saved = GPT(GPTConfig(vocab_size=8192, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    here = GPT(GPTConfig(vocab_size=387, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    shapes = {f"model/{n}": tuple(p.shape) for n, p in saved.named_parameters()}
    check_fits(shapes, saved, tmp_path / "step_00000001")  # fits itself
    with pytest.raises(ConfigError, match=r"tok_emb.weight is \(8192, 32\) there and \(387, 32\) here "
                                          r"\(vocabulary 8192 there, 387 here\)"):
        check_fits(shapes, here, tmp_path / "step_00000001")


def _format2_file(tmp_path, step: int) -> dict:
    """A single-file checkpoint as the previous version wrote it (format 2), with its checksum file."""
    model = GPT(GPTConfig(vocab_size=64, max_seq_len=16, n_layer=1, n_head=2, d_model=32))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {"format": 2, "step": step, "model": params, "guard": {"good_steps": step},
             "optimizer": {"adam_step": step, "state": {n: {"exp_avg": t * 0.1, "exp_avg_sq": t * t} for n, t in
                                                        params.items()}},
             "fp8_scaling": {}, "monitors": None, "rng": [rng_state()], "layout": "1 process(es)", "config": {}}
    path = tmp_path / "checkpoints" / f"step_{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    data = path.read_bytes()
    path.with_name(path.name + ".sha256").write_text(json.dumps({"bytes": len(data),
                                                                 "sha256": hashlib.sha256(data).hexdigest()}))
    return state


def test_an_earlier_single_file_checkpoint_is_refused_with_the_command_that_converts_it(tmp_path):
    old = _format2_file(tmp_path, 3)
    store = CheckpointStore(tmp_path)
    with pytest.raises(ConfigError, match=r"^checkpoint .*step_00000003.pt was written by an earlier version .* "
                                          rf"convert it with `python -m launcher.checkpoint convert {tmp_path}`"):
        store.resumable()
    path = convert(tmp_path)
    assert path.name == "step_00000003" and store.resumable() == (path, None)
    assert not store.legacy() and (store.dir / "step_00000003.pt.converted").exists()
    new = read_whole_checkpoint(path)
    assert new["step"] == new["optimizer"]["adam_step"] == 3 and new["guard"] == old["guard"]
    for name, tensor in old["model"].items():
        assert torch.equal(new["model"][name], tensor)
        for key, value in old["optimizer"]["state"][name].items():
            assert torch.equal(new["optimizer"]["state"][name][key], value)


@pytest.mark.parametrize("damage, reason", [
    (lambda p: _truncate(_shard(p), _shard(p).stat().st_size // 2), r"truncated: __0_0.distcp has \d+ of \d+ bytes"),
    (lambda p: _truncate(_shard(p), 0), r"empty: __0_0.distcp has 0 of \d+ bytes"),
    (lambda p: _flip_a_byte(_shard(p)), "checksum mismatch: __0_0.distcp changed after saving"),
    (lambda p: _flip_a_byte(p / ".metadata"), "checksum mismatch: .metadata changed after saving"),
    (lambda p: _shard(p).unlink(), "__0_0.distcp is missing"),
    (lambda p: (p / "checksums.json").unlink(), "no checksum file"),
    (lambda p: (p / "checksums.json").write_text("{not json"), "its checksum file is unreadable"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage, reason):
    store = _three_checkpoints(tmp_path)
    newest = store.steps()[-1]
    assert store.problem(newest) is None
    damage(newest)
    assert store.problem(newest) is not None
    path, message = store.resumable()
    assert path.name == "step_00000004" and store.run_state(path)["step"] == 4
    assert "\n" not in message  # one line, naming the bad checkpoint and why
    assert re.search(rf"{re.escape(str(newest))} is damaged \({reason}.*\); renamed to \*\.damaged, resuming "
                     r"from step_00000004", message), message
    assert newest.with_name(newest.name + ".damaged").exists() and not newest.exists()
    assert store.resumable() == (path, None)  # the damaged one no longer shadows the good one


def test_no_intact_checkpoint_is_one_error_and_deletes_nothing(tmp_path):
    store = _three_checkpoints(tmp_path)
    for path in store.steps():
        _truncate(_shard(path), 10)
    with pytest.raises(CheckpointError, match=r"^no intact checkpoint to resume: .*step_00000006 is damaged "
                                              r"\(truncated: __0_0.distcp has 10 of \d+ bytes\); .*step_00000004 is "
                                              r"damaged .*set checkpoint.resume=false run.overwrite=true to start "
                                              r"over$"):
        store.resumable()
    assert len(list((tmp_path / "checkpoints").glob("*.damaged"))) == 2


def test_pruning_keeps_the_newest_intact_checkpoints_past_a_damaged_one(tmp_path):
    store = _three_checkpoints(tmp_path)
    _truncate(_shard(store.steps()[-1]), 5)  # step 6 torn after it was written
    store.save(5, _entries(5))
    # keep-2 counts intact checkpoints only: 4 and 5 stay (a plain "two newest" would have dropped 4)
    assert [p.name for p in store.steps()] == ["step_00000004", "step_00000005", "step_00000006"]
    assert store.latest().name == "step_00000005"
    assert store.resumable()[0].name == "step_00000005"
    for step in (6, 7, 8):  # the run goes on: the damaged one stays for inspection until pruning passes its step
        store.save(step, _entries(step))
        if step == 7:
            assert (tmp_path / "checkpoints" / "step_00000006.damaged").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000007", "step_00000008"]


def test_an_unreadable_checkpoint_is_one_line_not_a_traceback(tmp_path):
    store = _three_checkpoints(tmp_path)
    path = store.latest()
    (path / ".metadata").write_bytes(b"this is not a pickle")
    with pytest.raises(CheckpointError, match=r"^checkpoint .*step_00000006 cannot be read \(.*\); move it away"):
        store.run_state(path)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoints(tmp_path, monkeypatch):
    store = _three_checkpoints(tmp_path)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"^could not write checkpoint .*step_00000008 \(No space left on "
                                              r"device\); the previous checkpoints are intact"):
        store.save(8, _entries(8))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    assert store.resumable() == (store.steps()[-1], None)
    assert saved_shapes(store.steps()[-1])["payload"] == (1000,)
