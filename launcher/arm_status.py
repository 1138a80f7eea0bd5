"""How an arm's training ended, kept in its run folder so that the report can say it: ``<run_dir>/status.yaml``.

The trainer (launcher/trainer.py, ``train_arm``) writes ``running`` when the loop starts and the ending when it
returns or raises:

- ``completed``: reached run.max_steps;
- ``stopped``: the guard stopped it (a non-finite loss or gradient norm, or a spike; guard.action=stop), at that step;
  the bad step's record is ``bad_step_<step>.yaml`` beside it (problem, loss, gradient norm);
- ``stopped_by_warning``: the early warning stopped it (monitor.on_warning=stop), before any bad step;
- ``interrupted``: a signal or run.max_minutes; a checkpoint was saved and the same command resumes;
- ``crashed``: an exception ended the training (its type and first line are the reason).

A process killed without a word (``kill -9``, the kernel's out-of-memory killer) leaves ``running`` behind with its
folder lock released (launcher/run_folder.py): :func:`read_ending` calls that ``killed``. Runs written before this
file existed have none: their ending is read from the events and checkpoints (``unknown`` when they cannot tell).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

STATUS_FILE = "status.yaml"
LOCK_FILE = ".lock"  # launcher/run_folder.py's RunLock
BLEW_UP = ("stopped", "diverged", "loss_rose")  # the training itself failed (not the process, not the user)


@dataclass
class Ending:
    """How an arm ended (or that it has not): ``status`` as in the module docstring, plus ``killed``, ``diverged``
    (judged by the margin tool's rule, analysis/margin_report.py), ``loss_rose`` (completed, but its loss ended far
    above where it started: a blow-up the guard let through because every value was finite; set by the report),
    ``running`` (still at work) and ``unknown``."""

    status: str
    step: int
    reason: str = ""
    max_steps: Optional[int] = None
    loss: Optional[float] = None  # of the bad step (stopped), when recorded
    grad_norm: Optional[float] = None

    @property
    def ended(self) -> bool:
        return self.status != "running"

    @property
    def blew_up(self) -> bool:
        return self.status in BLEW_UP

    def describe(self) -> str:
        """One phrase, e.g. 'stopped by the guard at step 5 (gradient norm is inf)'."""
        why = f" ({self.reason})" if self.reason else ""
        if self.status == "completed":
            return f"completed {self.step} steps"
        if self.status == "stopped":
            return f"stopped by the guard at step {self.step}{why}"
        if self.status == "loss_rose":
            return f"completed {self.step} steps but blew up without a non-finite value{why}"
        if self.status == "diverged":
            return f"diverged at step {self.step} by the margin rule{why}"
        if self.status == "stopped_by_warning":
            return f"stopped by the early warning at step {self.step} (monitor.on_warning=stop){why}"
        if self.status == "interrupted":
            return f"interrupted: {self.reason}" if self.reason else f"interrupted at step {self.step}"
        if self.status == "crashed":
            return f"crashed after step {self.step}{why}"
        if self.status == "killed":
            return (f"killed after step {self.step} (the process ended without saving or saying why: a signal such "
                    "as kill -9, or the out-of-memory killer)")
        if self.status == "running":
            return f"still training (step {self.step} logged so far)"
        return f"logged {self.step} steps{why}"


def write_status(run_dir: Path, status: str, step: int, max_steps: int, reason: str = "") -> None:
    """Record ``status`` (atomically: a reader never sees half a file)."""
    path = Path(run_dir) / STATUS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"status": status, "step": int(step), "max_steps": int(max_steps),
                                   "reason": reason, "pid": os.getpid()}, sort_keys=False))
    tmp.replace(path)


def lock_is_held(run_dir: Path) -> bool:
    """True while a process holds the run folder's lock (it is training that arm now)."""
    from launcher.run_folder import RunLock

    return RunLock(Path(run_dir)).held()


def bad_steps(run_dir: Path) -> list[dict]:
    """The guard's records of rejected steps (``bad_step_*.yaml``), in step order."""
    records = []
    for path in sorted(Path(run_dir).glob("bad_step_*.yaml")):
        try:
            record = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _max_steps(run_dir: Path) -> Optional[int]:
    try:
        config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
        return int(config["run"]["max_steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def read_ending(run_dir: Path, last_logged_step: int, first_bad_step: Optional[int] = None) -> Ending:
    """How the arm of ``run_dir`` ended. ``last_logged_step``: its last step in the events; ``first_bad_step``: the
    first step of its guard/bad_steps series, if any (for runs without status.yaml)."""
    run_dir = Path(run_dir)
    records = bad_steps(run_dir)
    try:
        recorded = yaml.safe_load((run_dir / STATUS_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        recorded = {}
    max_steps = recorded.get("max_steps") or _max_steps(run_dir)
    status = recorded.get("status")
    step = int(recorded.get("step") or 0)
    reason = str(recorded.get("reason") or "")
    if status == "running":
        if lock_is_held(run_dir):
            return Ending("running", max(step, last_logged_step), max_steps=max_steps)
        status, step = "killed", max(step, last_logged_step)
    if status == "crashed":  # recorded with the step it started from
        step = max(step, last_logged_step)
    if status is None:  # an older run folder: what its files say
        if first_bad_step is not None and (max_steps is None or last_logged_step < max_steps):
            status, step = "stopped", first_bad_step
        elif max_steps is not None and last_logged_step >= max_steps:
            status, step = "completed", last_logged_step
        else:
            status, step = "unknown", last_logged_step
    if status == "stopped":
        record = next((r for r in records if int(r["step"]) == step), records[-1] if records else None)
        if record is not None:
            return Ending("stopped", step, str(record.get("problem", reason)), max_steps,
                          _number(record.get("loss")), _number(record.get("grad_norm")))
    return Ending(status, step, reason, max_steps)


def _number(value) -> Optional[float]:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
