"""Worker: ``python -m tests.paced_steps_worker <launcher.pretrain arguments>`` trains like the launcher, except that
each optimizer step takes at least ``TRAIN_TEST_STEP_MIN_S`` seconds (it sleeps after a faster step). A test that
needs a run to outlast a deadline on any machine, without making it longer than that on a slow one, paces it
(tests/slurm/test_slurm.py: the time-limit test's run must outlast its first leg). Sleeping changes no number."""

import os
import time

from launcher.stop_signals import STOP

STOP.trap_scheduler_signals()  # as `python -m launcher.pretrain` does, before torch loads

from launcher import pretrain  # noqa: E402
from launcher.trainer import Trainer

STEP_MIN_S = float(os.environ.get("TRAIN_TEST_STEP_MIN_S", "0.02"))
_train_step = Trainer.train_step


def paced_train_step(self, step: int):
    start = time.monotonic()
    result = _train_step(self, step)
    time.sleep(max(0.0, STEP_MIN_S - (time.monotonic() - start)))
    return result


if __name__ == "__main__":
    Trainer.train_step = paced_train_step
    pretrain.exit_with(pretrain.main())
