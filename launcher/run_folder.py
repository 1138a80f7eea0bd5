"""A run folder belongs to one training process group at a time, and holds one run.

- :class:`RunLock`: an exclusive lock (``<run_dir>/.lock``, ``fcntl.flock``) held by the logging rank while it
  trains; a second launch of the same arm stops at once with a message naming the holder. The lock goes with its
  process (also when it is killed), so a stale lock file never blocks a new run.
- :func:`start_fresh_or_resume`: a folder whose earlier run never saved a checkpoint is cleared before a new start
  (its events and offsets would mix with the new run's); a folder with checkpoints is resumed, or, with
  ``checkpoint.resume=false``, refused unless ``run.overwrite=true`` clears it first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Optional

from launcher.config import ConfigError

RUN_FILES = ("events.out.tfevents.*", "batch_offsets.bin", "bad_step_*.yaml", "changes.yaml", "status.yaml",
             "checkpoints/step_*", "checkpoints/latest", "checkpoints/*.tmp",  # step_*: checkpoint folders, damaged,
             "checkpoints/warning_step_*")  # partial and earlier-format ones; warning_step_*: kept at warning onsets


class RunLock:
    """Exclusive lock on a run folder for the lifetime of the holder (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._file = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(f"{self.path.parent} is in use by {holder}; wait for that run to end (or stop it), or "
                              "use another run.experiment") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def run_files(run_dir: Path) -> list[Path]:
    """The files and checkpoint folders a run writes into its folder (not config.yaml, not the lock)."""
    # a set: the patterns overlap (a partial save step_N.tmp matches two of them)
    return sorted({p for pattern in RUN_FILES for p in run_dir.glob(pattern)})


def start_fresh_or_resume(run_dir: Path, latest: Optional[Path], resume: bool, overwrite: bool) -> Optional[str]:
    """Apply the folder policy of the module docstring before a run starts; returns a message for the user, if any.
    ``latest``: the folder's newest checkpoint (whether or not resuming)."""
    leftovers = run_files(run_dir)
    if latest is not None and not resume and not overwrite:
        raise ConfigError(f"{run_dir} holds an earlier run (checkpoint {latest.name}) and checkpoint.resume=false: "
                          "set run.overwrite=true to delete it and start over, checkpoint.resume=true to continue it, "
                          "or use another run.experiment")
    if leftovers and (overwrite or latest is None):
        for path in leftovers:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        why = "run.overwrite=true" if overwrite else "the earlier run never saved a checkpoint"
        return f"started over in {run_dir}: removed {len(leftovers)} file(s) of an earlier run ({why})"
    return None
