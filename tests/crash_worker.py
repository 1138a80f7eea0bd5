"""Worker: ``python -m tests.crash_worker <launcher.pretrain arguments>`` trains like the launcher, except that in the
first leg of a SLURM job (SLURM_RESTART_COUNT unset or 0) the process kills itself with SIGKILL, as a crashed node
or the OOM killer would, right after optimizer step ``TRAIN_TEST_CRASH_STEP`` (tests/slurm/test_slurm.py: a job
requeued after a failed step when it saved a newer checkpoint, and one that did not)."""

import os
import signal

from launcher import pretrain
from launcher.trainer import Trainer

CRASH_STEP = int(os.environ.get("TRAIN_TEST_CRASH_STEP", "0"))
_train_step = Trainer.train_step


def crashing_train_step(self, step: int):
    result = _train_step(self, step)
    if step + 1 == CRASH_STEP and int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0:
        print(f"[test] killing this process after step {step + 1}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return result


if __name__ == "__main__":
    Trainer.train_step = crashing_train_step
    pretrain.exit_with(pretrain.main())
