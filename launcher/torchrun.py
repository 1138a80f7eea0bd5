"""``python -m launcher.torchrun ARGS``: torchrun (same arguments) whose Ctrl-C ends like a single process's.

Plain torchrun answers Ctrl-C (or SIGTERM) by passing the signal on to its workers, which finish their step and
save a checkpoint (launcher/trainer.py), and then by raising SignalException: a long traceback and exit status 1,
although nothing went wrong. Here the same stop ends with one line and status 128 + signal (130 for Ctrl-C), as
``python -m launcher.pretrain`` does alone.
"""

from __future__ import annotations

import os
import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    os.environ["LAUNCHER_TORCHRUN"] = "1"  # the workers then need not explain torchrun's traceback
    try:
        torchrun(argv)
    except SignalException as err:
        print(f"[torchrun] {err.sigval.name}: the workers were asked to save a checkpoint at the end of their step "
              "(their lines above say whether they did); the same command resumes", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
