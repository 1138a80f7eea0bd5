"""Data preparation and the batch sequence: determinism, rank slicing, replay, and errors that name the fix."""

import json
import subprocess
import sys

import numpy as np
import pytest

from launcher.data import BatchSchedule, DataError, OffsetRecorder, TokenData, step_offsets
from launcher.prepare_data import PrepareError, main as prepare_main, prepare
from tests.runs import REPO


def test_embedded_corpus_is_real_text(kjv_data):
    meta = json.loads((kjv_data / "meta.json").read_text())
    assert meta["tokens"]["train"] > 500_000 and meta["tokens"]["val"] > 10_000
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(kjv_data / "tokenizer.json"))
    data = TokenData.open(kjv_data)
    text = tok.decode(list(map(int, data.train[:200])))
    assert "the" in text.split() and "and" in text.split()


def test_same_seed_same_batches_different_seed_different(kjv_data):
    data = TokenData.open(kjv_data)
    a = BatchSchedule(data, seed=1, seq_len=32, global_batch_size=8, micro_batch_size=4)
    b = BatchSchedule(data, seed=1, seq_len=32, global_batch_size=8, micro_batch_size=4)
    c = BatchSchedule(data, seed=2, seq_len=32, global_batch_size=8, micro_batch_size=4)
    for step in (0, 5, 1000):
        assert all((x1 == x2).all() and (y1 == y2).all()
                   for (x1, y1), (x2, y2) in zip(a.micro_batches(step), b.micro_batches(step)))
        assert not np.array_equal(a.offsets(step), c.offsets(step))
    x, y = a.micro_batches(3)[0]
    assert x.shape == (4, 32) and (x[:, 1:] == y[:, :-1]).all()  # targets are inputs shifted by one


def test_ranks_partition_the_global_batch(kjv_data):
    data = TokenData.open(kjv_data)
    single = BatchSchedule(data, 7, 16, global_batch_size=8, micro_batch_size=2)
    ranks = [BatchSchedule(data, 7, 16, 8, 2, dp_rank=r, dp_size=2) for r in range(2)]
    rows = {tuple(x_row.tolist()) for s in ranks for x, _ in s.micro_batches(4) for x_row in x}
    expected = {tuple(x_row.tolist()) for x, _ in single.micro_batches(4) for x_row in x}
    assert rows == expected and len(rows) == 8


def test_recorded_offsets_replay_and_resume_truncation(kjv_data, tmp_path):
    data = TokenData.open(kjv_data)
    path = tmp_path / "batch_offsets.bin"
    recorder = OffsetRecorder(path, 4, start_step=0)
    for step in range(5):
        recorder.record(step_offsets(3, step, 4, 16, len(data.train)))
    OffsetRecorder(path, 4, start_step=3)  # resuming at step 3 drops steps 3 and 4
    assert path.stat().st_size == 3 * 4 * 8
    with pytest.raises(DataError, match="no config.yaml beside it"):
        BatchSchedule(data, seed=999, seq_len=16, global_batch_size=4, micro_batch_size=4, replay_from=str(path))
    (tmp_path / "config.yaml").write_text("data: {global_batch_size: 4, seq_len: 16}\n")  # as a run folder holds
    replay = BatchSchedule(data, seed=999, seq_len=16, global_batch_size=4, micro_batch_size=4, replay_from=str(path))
    assert np.array_equal(replay.offsets(2), step_offsets(3, 2, 4, 16, len(data.train)))
    with pytest.raises(DataError, match="replayed offsets end at step 3"):
        replay.offsets(3)
    with pytest.raises(DataError, match="global_batch_size=4 there, 2 here.*Set data.global_batch_size=4"):
        BatchSchedule(data, 1, 16, global_batch_size=2, micro_batch_size=2, replay_from=str(path))  # 12 offsets


def test_missing_data_names_the_prepare_command(tmp_path):
    with pytest.raises(DataError, match="python -m launcher.prepare_data --source <your .*--out"):
        TokenData.open(tmp_path / "nothing")


PREPARED_FILES = ("train.bin", "val.bin", "tokenizer.json")


def test_embedded_corpus_prepares_without_datasets(kjv_data, tmp_path):
    """The GPU machine has no HF ``datasets``: in a process where importing it fails, the embedded corpus prepares
    anyway, to the same bytes as the session's folder (same arguments, another process)."""
    out = tmp_path / "kjv"
    code = ("import sys; sys.modules['datasets'] = None  # any import of datasets now raises ImportError\n"
            "from pathlib import Path\n"
            "from launcher.prepare_data import prepare\n"
            f"prepare(['kjv'], Path({str(out)!r}), tokenizer='bpe', vocab_size=2048)\n"
            "assert sys.modules['datasets'] is None\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in PREPARED_FILES + ("meta.json",):
        assert (out / name).read_bytes() == (kjv_data / name).read_bytes(), name


def test_embedded_corpus_prepares_as_through_datasets(kjv_data, tmp_path):
    """The same chapters as a local text file, read by ``datasets`` (how the embedded corpus was prepared before it
    was read directly): the same documents, split, vocabulary and tokens, byte for byte."""
    pytest.importorskip("datasets")
    from launcher.prepare_data import kjv_chapters

    chapters = tmp_path / "kjv_chapters.txt"
    chapters.write_text("\n\n".join(kjv_chapters()) + "\n", encoding="utf-8")
    meta = prepare([str(chapters)], tmp_path / "through_datasets", tokenizer="bpe", vocab_size=2048)
    embedded = json.loads((kjv_data / "meta.json").read_text())
    assert (meta["documents"], meta["tokens"]) == (embedded["documents"], embedded["tokens"])
    for name in PREPARED_FILES:
        assert (tmp_path / "through_datasets" / name).read_bytes() == (kjv_data / name).read_bytes(), name


def test_prepare_local_text_and_jsonl(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("\n\n".join(f"Document number {i} says hello to the world." for i in range(60)))
    meta = prepare([str(txt)], tmp_path / "out_txt", tokenizer="bpe", vocab_size=600)
    assert meta["documents"]["train"] + meta["documents"]["val"] == 60
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n".join(json.dumps({"body": f"row {i} of json text"}) for i in range(40)))
    meta = prepare([str(jl)], tmp_path / "out_json", tokenizer="bpe", vocab_size=600, text_field="body")
    data = TokenData.open(tmp_path / "out_json")
    assert len(data.train) == meta["tokens"]["train"] > 0


def test_prepare_errors_are_messages(tmp_path, capsys):
    assert prepare_main(["--source", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"body": "x"}\n{"body": "y"}\n')
    with pytest.raises(PrepareError, match="no column 'text'"):
        prepare([str(jl)], tmp_path / "o2")
    with pytest.raises(PrepareError, match="tiktoken"):
        import os
        os.environ["TIKTOKEN_CACHE_DIR"] = str(tmp_path / "empty_cache")
        try:
            prepare(["kjv"], tmp_path / "o3", tokenizer="gpt2")
        finally:
            del os.environ["TIKTOKEN_CACHE_DIR"]
