"""What an onset of the early warning does (``monitor.on_warning``; the rule is launcher/monitors/warning.py).

- ``log``: nothing beyond the console line and the ``warning/on`` tag (the monitors do that).
- ``checkpoint``: save a checkpoint at the onset step and keep it, ``checkpoints/warning_step_N/``, outside the
  two-kept rotation (``CheckpointStore.keep``).
- ``stop``: the same, then end the run with status ``stopped by warning`` and exit status
  :data:`EXIT_STATUS` (4) with a one-line reason; slurm/pretrain_fp8.sh does not requeue that status.
- ``switch_fix``: switch ``attention.fix`` to ``monitor.switch_fix_to`` first, save and keep the checkpoint (it holds
  the switched settings and the switch), and train on. The switch is recorded in ``changes.yaml`` with its step and
  why; every later checkpoint carries it (:class:`Switch`), so a resume of the same command continues with the
  switched fix, exactly as the run would have gone on (the command's own ``attention.fix`` is what the run started
  with, and the switch is re-applied to it, :func:`resume_switch`).

The trainer calls these at the steps the monitors ran (every rank, so that saves stay collective).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

EXIT_STATUS = 4
"""Exit status of ``python -m launcher.pretrain`` when monitor.on_warning=stop ended an arm (and no guard stopped
one: a guard stop is 3)."""
KEPT_LABEL = "warning"
SOURCE = "monitor.on_warning=switch_fix"  # the `by` of a switch's entry in changes.yaml


@dataclass(frozen=True)
class Switch:
    """attention.fix switched from ``before`` to ``after`` at step ``step`` (training after that step uses it)."""

    step: int
    before: str
    after: str

    def to_dict(self) -> dict:
        return {"step": self.step, "field": "attention.fix", "from": self.before, "to": self.after}

    @classmethod
    def from_dict(cls, record: dict) -> "Switch":
        return cls(int(record["step"]), str(record["from"]), str(record["to"]))


def switched(config, fix: str):
    """``config`` with attention.fix = ``fix`` (a new Config; the given one is left as it is)."""
    return dataclasses.replace(config, attention=dataclasses.replace(config.attention, fix=fix))


def resume_switch(config, state: dict) -> tuple[object, Optional[Switch]]:
    """(config to resume with, the switch the checkpoint carries or None). A checkpoint written after a switch holds
    it: the command's config (which still says the fix the run started with) gets the switched fix back. A command
    asking for yet another fix is left as it is, so the usual comparison with the checkpoint's settings refuses it
    (or records it with run.allow_changes)."""
    record = state.get("warning_switch")
    if not record:
        return config, None
    switch = Switch.from_dict(record)
    if config.attention.fix == switch.before:
        config = switched(config, switch.after)
    return config, switch


def record_switch(run_dir: Path, switch: Switch, reason: str) -> None:
    """Append the switch to ``run_dir/changes.yaml`` (dropping a switch entry of an earlier attempt at the same or
    a later step, which a resume from an earlier checkpoint redoes)."""
    log = run_dir / "changes.yaml"
    entries = (yaml.safe_load(log.read_text()) or []) if log.is_file() else []
    entries = [e for e in entries if not (e.get("by") == SOURCE and e.get("step", 0) >= switch.step)]
    entries.append({"step": switch.step, "by": SOURCE, "reason": reason,
                    "changes": {"attention.fix": {"from": switch.before, "to": switch.after}}})
    log.write_text(yaml.safe_dump(entries, sort_keys=False))


def keeps_entry(entry: dict, start_step: int, switch: Optional[Switch]) -> bool:
    """Whether a changes.yaml entry still describes the run resumed at ``start_step``: changes before it, and the
    switch its checkpoint carries (recorded at that very step when the onset checkpoint is the one resumed)."""
    if entry.get("by") == SOURCE:
        return switch is not None and entry.get("step") == switch.step
    return entry.get("step", 0) < start_step
