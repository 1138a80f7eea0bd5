"""The run lock without flock (launcher/run_folder.py): a live holder refuses a second run, a dead one on this host,
an earlier leg of the same SLURM job and a holder without heartbeat (a crashed node) are taken over."""

import json
import os
import subprocess
import sys
import time

import pytest

from launcher import run_folder
from launcher.config import ConfigError
from launcher.run_folder import RunLock


def _lock_of(tmp_path, **holder) -> None:
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "job": "", "since": "then",
                                                **holder}) + "\n")


def test_a_live_holder_refuses_and_a_released_lock_is_free(tmp_path):
    lock = RunLock(tmp_path).acquire()
    with pytest.raises(ConfigError, match=rf"is in use by pid {os.getpid()} on .* last heartbeat \d+ s ago"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    RunLock(tmp_path).acquire().release()


def test_a_holder_gone_from_this_host_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lock_of(tmp_path, pid=int(dead.stdout), host=os.uname().nodename)
    RunLock(tmp_path).acquire().release()


def test_an_earlier_leg_of_the_same_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _lock_of(tmp_path, job="4242")  # on another node, heartbeat fresh: the node crashed and the job was requeued
    RunLock(tmp_path).acquire().release()


def test_a_lock_on_another_node_is_kept_until_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _lock_of(tmp_path, job="7")
    with pytest.raises(ConfigError, match=r"in use by pid 1 on elsewhere \(SLURM job 7\)"):
        RunLock(tmp_path).acquire()
    old = time.time() - run_folder.STALE_S - 5
    os.utime(tmp_path / ".lock", (old, old))
    RunLock(tmp_path).acquire().release()


def test_the_holder_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path).acquire()
    old = time.time() - 1000
    os.utime(tmp_path / ".lock", (old, old))
    time.sleep(0.3)
    assert time.time() - (tmp_path / ".lock").stat().st_mtime < 5
    lock.release()
