"""Device probe of kernels/gluon_flash.py, 2026-12-08: ``../2026-12-07-boundary/probe.py`` (the same cases, columns
and variants) with two more variants: "gluon dQ finished" (``BWD_DQ_FINISH``, built 2026-12-08: the key tile that adds last into
a query tile writes its dQ, and the separate finishing launch goes; ordered dQ) and "gluon atomic first store dQ
finished" (the same behind the atomic dQ's stored first share); and the forward with consumer 1 lagging
(``FWD_LAG``, built 2026-12-08), with and without a deeper K/V ring at head_dim 64.

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
# the forward with consumer 1 a step behind consumer 0 (FWD_LAG), with the K/V ring as now and one stage deeper at
# head_dim 64 (the lead costs the leader a stage of prefetch), and the deeper ring alone
boundary.base.VARIANTS["gluon lag"] = {"FWD_LAG": True}
boundary.base.VARIANTS["gluon lag 4 stages"] = {"FWD_LAG": True, "FWD_STAGES": {64: 4, 128: 2}}
boundary.base.VARIANTS["gluon 4 stages"] = {"FWD_STAGES": {64: 4, 128: 2}}
# and with a second Q slot per consumer, so that the producer loads the next tile's Q without waiting for either
# consumer's release of this one (the lead's other possible brake)
boundary.base.VARIANTS["gluon lag 2 Q slots"] = {"FWD_LAG": True, "FWD_Q_SLOTS": 2}

if __name__ == "__main__":
    sys.exit(boundary.base.main())
