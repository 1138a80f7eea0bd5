"""Device probe of kernels/gluon_flash.py, 2026-12-06 (trace session): ``../2026-12-06-d64/probe.py`` (check and
time, same cases and columns) with this session's variants. Call 2 (which ran a full copy of that file, commit
3ab01be): the forward's PV wait held after the softmax (``FWD_PIN_PV_WAIT``, removed after it) against ptxas's
placement ("gluon ptxas-wait"). Call 3 (prepared, not run): two Q slots per consumer ("gluon 2 Q slots",
``FWD_Q_SLOTS = 2``) against one, and with it the next tile's first Q K^T issued before the epilogue ("gluon 2 Q
slots cross-tile", ``FWD_CROSS_TILE``). VARIANTS set module attributes of kernels.gluon_flash while timing.

    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/probe.py check [--deterministic]
    PYTHONPATH=. python docs/device-runs/2026-12-06-trace/probe.py time [--shapes 8,12,1024,64 ...] [--only ...]
"""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("probe_d64", Path(__file__).parent.parent / "2026-12-06-d64/probe.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

base.VARIANTS = {
    "gluon": {},
    "gluon 2 Q slots": {"FWD_Q_SLOTS": 2},  # the default is 1
    "gluon 2 Q slots cross-tile": {"FWD_Q_SLOTS": 2, "FWD_CROSS_TILE": True},  # the default is not cross-tile
}

if __name__ == "__main__":
    if "--two-consumers" in sys.argv:
        sys.exit("--two-consumers belongs to the 2026-12-06-d64 session's kernel")
    sys.exit(base.main())
