"""Checkpoints that survive interruption: written under a temporary name, then renamed, then the 'latest' pointer is
moved. A crash mid-save leaves the previous checkpoint intact, and a bad (non-finite) state is never saved."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

KEEP = 2  # checkpoints kept per arm: the newest and one before it


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointStore:
    """Checkpoints of one arm in <run_dir>/checkpoints/step_XXXXXXXX.pt plus a 'latest' file naming the newest."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "checkpoints"

    def latest(self) -> Optional[Path]:
        pointer = self.dir / "latest"
        if not pointer.is_file():
            return None
        path = self.dir / pointer.read_text().strip()
        return path if path.is_file() else None

    def save(self, step: int, state: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step:08d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
        pointer_tmp = self.dir / "latest.tmp"
        pointer_tmp.write_text(path.name)
        pointer_tmp.replace(self.dir / "latest")
        for old in sorted(self.dir.glob("step_*.pt"))[:-KEEP]:
            old.unlink()
        return path

    def load(self, path: Path, map_location) -> dict:
        # weights_only=False: the state holds python/numpy RNG states, which are not plain tensors.
        return torch.load(path, map_location=map_location, weights_only=False)
