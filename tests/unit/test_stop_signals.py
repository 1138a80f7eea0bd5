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


def test_a_second_ctrl_c_as_the_training_loop_ends_still_aborts(monkeypatch, capsys):
    """CI once saw a second Ctrl-C that arrived while ``while_training`` put the handlers back read as a first one
    ("came outside the training loop") and the run ended as if stopped, not aborted. Here the second Ctrl-C is
    raised just before the first handler goes back; ``signal.signal`` runs pending handlers before it swaps."""
    from launcher.stop_signals import StopRequests

    stop = StopRequests()
    real_signal = signal.signal
    sent = []

    def signal_with_a_ctrl_c_pending(sig, handler):
        if not sent and stop.requested:  # the first restore call, after the first Ctrl-C was handled
            sent.append(sig)
            signal.raise_signal(signal.SIGINT)  # trips the C-level flag; the Python handler runs inside the call
        return real_signal(sig, handler)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stop.while_training():
            signal.raise_signal(signal.SIGINT)  # the first Ctrl-C: a stop is requested
            assert stop.requested
            monkeypatch.setattr(signal, "signal", signal_with_a_ctrl_c_pending)
    monkeypatch.setattr(signal, "signal", real_signal)
    assert sent and "outside the training loop" not in capsys.readouterr().out
    assert not stop.requested and not stop.training
    assert signal.getsignal(signal.SIGINT) is before
