"""A run folder belongs to one training process group at a time, and holds one run.

- :class:`RunLock`: an exclusive lock (``<run_dir>/.lock``) held by the logging rank while it trains; a second
  launch of the same arm stops at once with a message naming the holder. It needs no ``flock`` (which Lustre and NFS
  mounts without lock support refuse): the lock file is created with O_CREAT | O_EXCL, atomic on local and shared
  file systems, and its holder refreshes its modification time every HEARTBEAT_S seconds. A lock is stale, and is
  taken over, when its holder is an earlier leg of the same SLURM job (a requeued job keeps its id), a process gone
  on this host, or anywhere when its heartbeat is older than STALE_S (a crashed node): a killed or crashed run never
  blocks the next one for longer than that.
- :func:`start_fresh_or_resume`: a folder whose earlier run never saved a checkpoint is cleared before a new start
  (its events and offsets would mix with the new run's); a folder with checkpoints is resumed, or, with
  ``checkpoint.resume=false``, refused unless ``run.overwrite=true`` clears it first.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from launcher.config import ConfigError

RUN_FILES = ("events.out.tfevents.*", "batch_offsets.bin", "bad_step_*.yaml", "changes.yaml", "status.yaml",
             "checkpoints/step_*", "checkpoints/latest", "checkpoints/*.tmp",  # step_*: checkpoint folders, damaged,
             "checkpoints/warning_step_*")  # partial and earlier-format ones; warning_step_*: kept at warning onsets
HEARTBEAT_S = 30.0
STALE_S = 180.0  # six missed heartbeats: longer than any pause of a live holder, short against a requeue


class RunLock:
    """Exclusive lock on a run folder for the lifetime of the holder (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self._record: Optional[str] = None
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None

    @staticmethod
    def _me() -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "job": os.environ.get("SLURM_JOB_ID", ""),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = json.dumps(self._me())
        for _ in range(5):  # another launcher may take a stale lock at the same moment: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                seen, holder, age = self._holder()
                why_stale = self._stale(holder, age)
                if why_stale is None:
                    raise ConfigError(self._in_use(holder, age)) from None
                self._take_over(seen)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(record + "\n")
            self._record = record
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()
            return self
        raise ConfigError(f"{self.path.parent} is being taken over by another launch at the same time; retry")

    def held(self) -> bool:
        """True while a live process holds this lock (a stale one, as defined above, is not held)."""
        seen, holder, age = self._holder()
        return bool(seen) and self._stale(holder, age) is None

    def _holder(self) -> tuple[str, dict, float]:
        """(the lock file's text, its holder as recorded, seconds since its last heartbeat)."""
        try:
            seen = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "", {}, float("inf")
        try:
            holder = json.loads(seen)
        except ValueError:  # an older version's lock ("pid N on HOST since ...") or a torn write
            holder = {}
        return seen, holder if isinstance(holder, dict) else {}, age

    @staticmethod
    def _stale(holder: dict, age: float) -> Optional[str]:
        """Why the lock's holder is gone (None: it may be alive)."""
        job = os.environ.get("SLURM_JOB_ID", "")
        if job and holder.get("job") == job:
            return "an earlier leg of this job"
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return "its process is gone"
            except PermissionError:
                pass  # alive, another user's
        if age > STALE_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def _take_over(self, seen: str) -> None:
        """Move the stale lock ``seen`` aside, unless a live holder replaced it in the meantime (then put it back)."""
        aside = self.path.with_name(f".lock.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != seen:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink()

    def _in_use(self, holder: dict, age: float) -> str:
        who = (f"pid {holder.get('pid')} on {holder.get('host')}" + (f" (SLURM job {holder['job']})"
                                                                    if holder.get("job") else "")
               + f" since {holder.get('since')}") if holder else "another process"
        return (f"{self.path.parent} is in use by {who}, last heartbeat {age:.0f} s ago; wait for that run to end (or "
                f"stop it), or use another run.experiment (a lock without heartbeat for {STALE_S:.0f} s is taken over)")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self.path.read_text() == self._record + "\n":
                    os.utime(self.path)
            except OSError:
                pass  # a file system hiccup: the next beat retries

    def release(self) -> None:
        if self._record is None:
            return
        self._stop.set()
        try:
            if self.path.read_text() == self._record + "\n":
                self.path.unlink()
        except OSError:
            pass
        self._record = None


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
