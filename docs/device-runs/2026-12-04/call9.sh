#!/usr/bin/env bash
# nvidia-h200: the GPU tier's and the grids' report logs that call 8 could not return (a call returns few files:
# one tarball here), then the `decide` grid (grids.sh), alone on the GPU.
mkdir -p $OUT && tar czf $OUT/call8_logs.tgz /tmp/gputier/*.log /tmp/gputier/commit.txt /tmp/p34/*_report.log /tmp/p34/machine* 2>/dev/null; tar tzf $OUT/call8_logs.tgz
MAX_MINUTES=4.5 PROBE=100 bash docs/device-runs/2026-12-04/grids.sh decide
