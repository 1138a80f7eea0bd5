"""Device probe of kernels/gluon_flash.py, 2026-12-08: ``../2026-12-07-boundary/probe.py`` (the same cases, columns
and variants) with two more variants: "gluon dQ finished" (``BWD_DQ_FINISH``, built 2026-12-08: the key tile that adds last into
a query tile writes its dQ, and the separate finishing launch goes; ordered dQ) and "gluon atomic first store dQ
finished" (the same behind the atomic dQ's stored first share).

    PYTHONPATH=. python docs/device-runs/2026-12-08-trainer/probe.py time [--shapes 8,12,1024,64 ...] [--only ...]
"""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("probe_boundary",
                                               Path(__file__).parent.parent / "2026-12-07-boundary/probe.py")
boundary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(boundary)

boundary.base.VARIANTS["gluon dQ finished"] = {"BWD_DQ_FINISH": True}
boundary.base.VARIANTS["gluon atomic first store dQ finished"] = {"BWD_ATOMIC_FIRST_STORE": True, "BWD_DQ_FINISH": True}

if __name__ == "__main__":
    sys.exit(boundary.base.main())
