"""Device probe of kernels/gluon_flash.py, 2026-12-07 (boundary): ``../2026-12-06-d64/probe.py`` (check and time,
same cases and columns) with O divided by one reciprocal per row ("gluon row divide", ``FWD_ROW_DIVIDE``) beside
the element division, and the bf16 O by TMA ("gluon O by TMA", ``FWD_O_TMA``) (call 1b also timed the cross-tile order, since removed). VARIANTS set module attributes of
kernels.gluon_flash while timing.

    PYTHONPATH=. python docs/device-runs/2026-12-07-boundary/probe.py time [--shapes 8,12,1024,64 ...] [--only ...]
"""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("probe_d64", Path(__file__).parent.parent / "2026-12-06-d64/probe.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

base.VARIANTS = {  # explicit values, whichever division is the default
    "gluon element divide": {"FWD_ROW_DIVIDE": False, "FWD_O_TMA": False},
    "gluon row divide": {"FWD_ROW_DIVIDE": True, "FWD_O_TMA": False},
    "gluon O by TMA": {"FWD_ROW_DIVIDE": False, "FWD_O_TMA": True},  # the bf16 O staged in shared memory
    "gluon O by TMA + row divide": {"FWD_ROW_DIVIDE": True, "FWD_O_TMA": True},
    # the backward with ordered dQ: the first share of each query tile added into zeros (now) or stored
    "gluon first add": {"BWD_DQ_FIRST_STORE": False},
    "gluon first store": {"BWD_DQ_FIRST_STORE": True},
    # the backward with atomic dQ: adds into zeros (now) or behind a stored first share
    "gluon atomic first store": {"BWD_ATOMIC_FIRST_STORE": True},
    # dK and dV by plain stores (now) or by TMA from the dQ double buffer
    "gluon dK dV by TMA": {"BWD_DKV_TMA": True},
    # ("gluon xtile" and "gluon xtile row divide", timed in call 1b, went with FWD_CROSS_TILE after it)
}

if __name__ == "__main__":
    if "--two-consumers" in sys.argv:
        sys.exit("--two-consumers belongs to the 2026-12-06-d64 session's kernel")
    sys.exit(base.main())
