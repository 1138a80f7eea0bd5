#!/usr/bin/env bash
# nvidia-h200: the GPU tier's and the grids' report logs that call 8 could not return (too many files), then the
# `decide` grid (grids.sh), alone on the GPU.
mkdir -p $OUT/logs && cp /tmp/gputier/*.log /tmp/p34/*_report.log /tmp/gputier/commit.txt $OUT/logs/ && ls $OUT/logs
MAX_MINUTES=4.5 PROBE=100 bash docs/device-runs/2026-12-04/grids.sh decide
