"""Stop requests by signal, for the whole training process.

SLURM's time-limit warning (USR1, passed on by slurm/pretrain_fp8.sh) and preemption or scancel (TERM) may come at
any moment of a leg, also while the process is still importing torch or resuming: an untrapped USR1 or TERM would
kill it there, and the leg would end without a word. So ``launcher.pretrain`` traps both on its first lines
(``STOP.trap_scheduler_signals``); the trainer adds Ctrl-C while it trains (``STOP.while_training``) and checks
``STOP.requested`` at the end of each step, then saves and returns. A stop asked before the first step is honoured
after that step. Once ``main`` has returned, ``STOP.ignore_while_exiting`` keeps both from killing the exit. Only the standard library is imported here: this module loads before torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator

SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """One per process (signals are per process): ``requested`` is set by the first stop signal."""

    def __init__(self):
        self.requested = False
        self.training = False

    def trap_scheduler_signals(self) -> None:
        """From now on, TERM and USR1 ask for a stop instead of killing the process."""
        for sig in SCHEDULER_SIGNALS:
            signal.signal(sig, self._handle)

    def ignore_while_exiting(self) -> None:
        """The process's work is done (and saved): from now on TERM and USR1 are ignored. Python's finalisation puts
        every signal handled in Python back to its default action, which for both ends the process, so a time-limit
        warning during the teardown of a finished leg (seconds, with torch) would end it with status 138 and the
        batch script would requeue a completed run (seen in tests/slurm); an ignored signal stays ignored. Ctrl-C
        gets the operating system's default: it still ends a slow teardown at once, without a traceback."""
        for sig in SCHEDULER_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    @contextlib.contextmanager
    def while_training(self) -> Iterator["StopRequests"]:
        """Ctrl-C, TERM and USR1 ask for a stop; the handlers from before come back afterwards. A stop that was
        asked and acted on inside is forgotten on the way out (the next arm or test starts afresh)."""
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, *SCHEDULER_SIGNALS)}
        self.training = True
        try:
            yield self
        finally:
            # Handlers back first, flags cleared last: a signal handled in between (signal.signal runs pending
            # handlers before it swaps) finds a consistent state, so a quick second Ctrl-C still aborts instead of
            # reading as a first one "outside the training loop" (seen once in CI).
            try:
                _put_back(previous)
            finally:
                self.training = False
                self.requested = False

    def _handle(self, signum, frame):
        if self.requested:
            if signum == signal.SIGINT:  # a second Ctrl-C means: stop now
                raise KeyboardInterrupt
            return  # SLURM may send TERM and USR1 together (preemption near the time limit): the save goes on
        self.requested = True
        if os.environ.get("RANK", "0") != "0":  # every rank gets the signal (torchrun passes it on): say it once
            return
        name = signal.Signals(signum).name
        if self.training:
            print(f"\n[train] {name}: finishing this step, then saving a checkpoint "
                  "(press Ctrl-C again to abort without saving)", flush=True)
            if "TORCHELASTIC_RUN_ID" in os.environ and "LAUNCHER_TORCHRUN" not in os.environ:
                print("[train] plain torchrun ends a stop with a SignalException traceback and status 1 after the "
                      "save; `python -m launcher.torchrun` (same arguments) ends it in one line", flush=True)
        else:
            print(f"\n[train] {name}: came outside the training loop; an arm still to train stops after its first "
                  "step and saves a checkpoint", flush=True)


def _put_back(handlers: dict) -> None:
    """Install ``handlers``, every one of them even when a pending second Ctrl-C raises KeyboardInterrupt from inside
    ``signal.signal``; that KeyboardInterrupt is raised again at the end."""
    abort = None
    for sig, handler in handlers.items():
        while signal.getsignal(sig) is not handler:
            try:
                signal.signal(sig, handler)
            except KeyboardInterrupt as err:
                abort = err
    if abort is not None:
        raise abort


STOP = StopRequests()
