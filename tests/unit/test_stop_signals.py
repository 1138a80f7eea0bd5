"""A time-limit signal during a finished process's teardown (tests/slurm saw it: a completed leg ended with status
138 and was requeued). Python's finalisation gives signals handled in Python their default action back, which for
USR1 and TERM ends the process; launcher.pretrain.exit_with ignores them first. The signal is sent from an object's
finaliser, i.e. during the teardown, so the race is reproduced deterministically."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, signal, sys
from launcher.stop_signals import STOP
STOP.trap_scheduler_signals()

class SignalledInTeardown:
    def __del__(self):
        os.kill(os.getpid(), signal.{sig})

kept_to_the_end = SignalledInTeardown()
if sys.argv[1] == "exit_with":
    from launcher.pretrain import exit_with
    exit_with(0)
sys.exit(0)
"""


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_a_signal_in_the_teardown_does_not_change_the_exit_status(sig):
    def run(how: str) -> int:
        return subprocess.run([sys.executable, "-c", SCRIPT.format(sig=sig), how], cwd=REPO, timeout=120,
                              capture_output=True).returncode

    assert run("plain") == -getattr(signal, sig)  # the hazard: the trapped handler is gone in the teardown
    assert run("exit_with") == 0
