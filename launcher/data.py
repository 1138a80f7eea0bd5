"""Token data on disk and the batch sequence of a run.

A prepared data folder (written by ``python -m launcher.prepare_data``) holds ``train.bin`` and ``val.bin`` (flat
token ids, uint16 or uint32) and ``meta.json``. Training batches are random windows of ``train.bin``; the window
offsets of step s are a pure function of (seed, s), so two runs with one seed see identical batches whatever their
process count, and a run can also replay the offsets recorded by another (the paper's replay).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch


class DataError(RuntimeError):
    """Missing or inconsistent data files; the message names the command that fixes it."""


def prepare_hint(data_dir: Path | str) -> str:
    """The command that prepares ``data_dir``. It names the source: without --source, prepare_data writes the
    embedded King James Bible, which is only right for the embedded corpus's folder."""
    if Path(data_dir) == Path("data/cache/kjv"):
        return f"python -m launcher.prepare_data --source kjv --out {data_dir}"
    return (f"python -m launcher.prepare_data --source <your .txt/.jsonl/.parquet files or folder, or a cached "
            f"Hugging Face dataset name> --out {data_dir}")


@dataclass
class TokenData:
    """Memory-mapped token splits of a prepared data folder."""

    data_dir: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def open(cls, data_dir: str | Path) -> "TokenData":
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        if data_dir.exists() and not data_dir.is_dir():
            raise DataError(f"data.data_dir={data_dir} is a file, not a data folder: point data.data_dir at a folder "
                            "written by `python -m launcher.prepare_data` (e.g. data/cache/kjv)")
        if not meta_path.is_file():
            raise DataError(f"no prepared data in {data_dir} (missing meta.json). Prepare it first:\n"
                            f"    {prepare_hint(data_dir)}\n(or point data.data_dir at a prepared folder)")
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        splits = {}
        for split in ("train", "val"):
            path = data_dir / f"{split}.bin"
            if not path.is_file():
                raise DataError(f"{path} is missing; prepare the data again:\n    {prepare_hint(data_dir)}")
            splits[split] = np.memmap(path, dtype=dtype, mode="r")
            if len(splits[split]) != meta["tokens"][split]:
                raise DataError(f"{path} holds {len(splits[split])} tokens but meta.json says {meta['tokens'][split]}; "
                                f"the folder is inconsistent, prepare it again:\n    {prepare_hint(data_dir)}")
        return cls(data_dir, meta, splits["train"], splits["val"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def check_fits(self, seq_len: int) -> None:
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) < seq_len + 2:
                raise DataError(f"the {name} split of {self.data_dir} has {len(split)} tokens, fewer than one "
                                f"sequence of data.seq_len={seq_len}; use more text or a shorter data.seq_len")


def step_offsets(seed: int, step: int, global_batch_size: int, seq_len: int, n_tokens: int) -> np.ndarray:
    """Start offsets of the ``global_batch_size`` training windows of optimizer step ``step``.

    A pure function of its arguments: numpy's Generator seeded with (seed, step) is reproducible across platforms.
    """
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=global_batch_size, dtype=np.int64)


def windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets (int64, (len(offsets), seq_len)) for windows starting at ``offsets``."""
    rows = np.stack([np.asarray(tokens[o:o + seq_len + 1], dtype=np.int64) for o in offsets])
    data = torch.from_numpy(rows)
    return data[:, :-1], data[:, 1:]


def _recorded_with(path: Path, global_batch_size: int, seq_len: int) -> Optional[str]:
    """Why the offsets file ``path`` cannot be replayed as the same batches, if it cannot: its run's config.yaml
    (beside it) must have recorded this global batch size and sequence length. Regrouping offsets of another batch
    size into steps of this one would replay other batches under the same step numbers."""
    import yaml

    config = path.parent / "config.yaml"
    if not config.is_file():
        return (f"data.replay_from={path}: no config.yaml beside it, so the batch size it was recorded with is "
                "unknown; give the batch_offsets.bin of a run folder (or copy that run's config.yaml next to it)")
    data = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
    recorded = {"data.global_batch_size": data.get("global_batch_size"), "data.seq_len": data.get("seq_len")}
    wanted = {"data.global_batch_size": global_batch_size, "data.seq_len": seq_len}
    differ = [f"{k}={recorded[k]} there, {wanted[k]} here" for k in wanted if recorded[k] != wanted[k]]
    if differ:
        return (f"data.replay_from={path} was recorded with other batches ({'; '.join(differ)}): the same steps "
                f"would not see the same batches. Set " + " ".join(f"{k}={recorded[k]}" for k in wanted
                                                                    if recorded[k] != wanted[k])
                + " to replay it exactly")
    return None


class BatchSchedule:
    """The training batches of a run, sliced for one data-parallel rank.

    Step s draws ``global_batch_size`` offsets; they are viewed as (accumulation steps, dp ranks, micro-batch) and
    rank r takes row [:, r]. Offsets come from (seed, step) or, when replaying, from a recorded offsets file.
    """

    def __init__(self, data: TokenData, seed: int, seq_len: int, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, replay_from: Optional[str] = None,
                 max_steps: Optional[int] = None):
        self.data, self.seed, self.seq_len = data, seed, seq_len
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.accum_steps = global_batch_size // (micro_batch_size * dp_size)
        self.replay: Optional[np.ndarray] = None
        if replay_from:
            path = Path(replay_from)
            if not path.is_file():
                raise DataError(f"data.replay_from={replay_from} does not exist; give a run's batch_offsets.bin")
            recorded_problem = _recorded_with(path, global_batch_size, seq_len)
            if recorded_problem:
                raise DataError(recorded_problem)
            recorded = np.fromfile(path, dtype=np.int64)
            if len(recorded) % global_batch_size:
                raise DataError(f"{path} holds {len(recorded)} offsets, not a multiple of "
                                f"data.global_batch_size={global_batch_size}: it was recorded with another batch size")
            self.replay = recorded.reshape(-1, global_batch_size)
            if max_steps is not None and len(self.replay) < max_steps:
                raise DataError(f"data.replay_from={replay_from} holds the offsets of {len(self.replay)} steps; "
                                f"run.max_steps={max_steps} needs {max_steps}: lower run.max_steps or replay a longer run")

    def offsets(self, step: int) -> np.ndarray:
        """All ranks' offsets of ``step`` (global_batch_size of them)."""
        if self.replay is not None:
            if step >= len(self.replay):
                raise DataError(f"the replayed offsets end at step {len(self.replay)}; cannot replay step {step}")
            return self.replay[step]
        return step_offsets(self.seed, step, self.global_batch_size, self.seq_len, len(self.data.train))

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (inputs, targets) micro-batches of ``step``, in accumulation order."""
        mine = self.offsets(step).reshape(self.accum_steps, self.dp_size, self.micro_batch_size)[:, self.dp_rank]
        return [windows(self.data.train, row, self.seq_len) for row in mine]

    def global_rows(self) -> list[torch.Tensor]:
        """Per micro-batch of :meth:`micro_batches` (any step), the index of each of its windows in ``offsets(step)``:
        accumulation step i, data-parallel rank r, row j -> i*dp*mb + r*mb + j. A window's index, unlike its place
        in a rank's micro-batch, is the same under every layout: the row keys of the attention's random bits are
        derived from it."""
        rows = torch.arange(self.global_batch_size).view(self.accum_steps, self.dp_size, self.micro_batch_size)
        return list(rows[:, self.dp_rank])


def eval_offsets(n_tokens: int, seq_len: int, count: int) -> np.ndarray:
    """Evenly spread, fixed windows of the validation split (the same every evaluation and every arm)."""
    last = n_tokens - seq_len - 1
    return np.linspace(0, last, num=count, dtype=np.int64)


class OffsetRecorder:
    """Appends each step's offsets to ``batch_offsets.bin`` (int64, global_batch_size per step), so a run can be
    audited or replayed. On resume the file is cut back to the resumed step, so it never holds a step twice; a file
    that is missing or shorter than the resumed step is completed from ``offsets_of(step)`` (the offsets are a pure
    function of the seed and the step, or the replayed file's)."""

    def __init__(self, path: Path, global_batch_size: int, start_step: int,
                 offsets_of: Optional[Callable[[int], np.ndarray]] = None):
        self.path, self.global_batch_size = path, global_batch_size
        path.parent.mkdir(parents=True, exist_ok=True)
        step_bytes = global_batch_size * 8
        size = path.stat().st_size if path.exists() else 0
        have = min(start_step, size // step_bytes)  # whole steps up to the resumed one
        with open(path, "ab") as f:
            f.truncate(have * step_bytes)
        if have < start_step and offsets_of is not None:
            for step in range(have, start_step):
                self.record(offsets_of(step))

    def record(self, offsets: np.ndarray) -> None:
        with open(self.path, "ab") as f:
            f.write(np.ascontiguousarray(offsets, dtype=np.int64).tobytes())
