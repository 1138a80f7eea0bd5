"""Worker: ``python -m tests.paused_save_worker <launcher.pretrain arguments>`` trains like the launcher, except that
each checkpoint save pauses once, ``CHECKPOINT_TEST_PAUSE_S`` seconds after its first bytes are on disk, and says so
(``[checkpoint] test pause``): a fault test kills or cancels the run inside a save (tests/distributed/test_faults.py,
tests/slurm/test_slurm.py)."""

import os
import time

from launcher.stop_signals import STOP

STOP.trap_scheduler_signals()  # as `python -m launcher.pretrain` does, before torch loads

from launcher import pretrain  # noqa: E402
from launcher.checkpoint import HashingWriter

PAUSE_S = float(os.environ.get("CHECKPOINT_TEST_PAUSE_S", "2"))


class PausingWriter(HashingWriter):
    """Writes like the launcher's writer, pausing once (after the first write) with that part flushed to the file."""

    def __init__(self, f):
        super().__init__(f)
        self.paused = False

    def write(self, data) -> int:
        written = super().write(data)
        if not self.paused:
            self.paused = True
            self.flush()
            print(f"[checkpoint] test pause: {self.size} bytes written, sleeping {PAUSE_S}s", flush=True)
            time.sleep(PAUSE_S)
        return written


if __name__ == "__main__":
    pretrain.exit_with(pretrain.main(checkpoint_writer=PausingWriter))
