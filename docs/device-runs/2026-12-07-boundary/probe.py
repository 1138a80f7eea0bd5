"""Device probe of kernels/gluon_flash.py, 2026-12-07 (boundary): ``../2026-12-06-d64/probe.py`` (check and time,
same cases and columns) with O divided by one reciprocal per row ("gluon row divide", ``FWD_ROW_DIVIDE``) and the
cross-tile order as rewritten after 2026-12-07's call 3 (``FWD_CROSS_TILE``, with two Q slots) beside the default. VARIANTS set module attributes of kernels.gluon_flash while timing.

    PYTHONPATH=. python docs/device-runs/2026-12-07-boundary/probe.py time [--shapes 8,12,1024,64 ...] [--only ...]
"""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("probe_d64", Path(__file__).parent.parent / "2026-12-06-d64/probe.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

base.VARIANTS = {  # explicit values: FWD_ROW_DIVIDE became the default after call 1's bits were prepared
    "gluon element divide": {"FWD_ROW_DIVIDE": False},
    "gluon row divide": {"FWD_ROW_DIVIDE": True},
    "gluon xtile": {"FWD_Q_SLOTS": 2, "FWD_CROSS_TILE": True, "FWD_ROW_DIVIDE": False},
    "gluon xtile row divide": {"FWD_Q_SLOTS": 2, "FWD_CROSS_TILE": True, "FWD_ROW_DIVIDE": True},
}

if __name__ == "__main__":
    if "--two-consumers" in sys.argv:
        sys.exit("--two-consumers belongs to the 2026-12-06-d64 session's kernel")
    sys.exit(base.main())
