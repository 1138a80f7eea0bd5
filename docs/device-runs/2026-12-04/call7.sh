#!/usr/bin/env bash
# nvidia-h200: the GPU test tier in the background (gputier.sh), then issue 34's exact_paper and exact_paper_fp32
# grids side by side (grids.sh).
# Run after `source .devcache/install.sh` (call 6 installed Transformer Engine on this machine).
setsid bash docs/device-runs/2026-12-04/gputier.sh > /tmp/gputier.out 2>&1 < /dev/null &
sleep 2
bash docs/device-runs/2026-12-04/grids.sh exact_paper_fp32 > /tmp/p34_fp32.out 2>&1 &
fp32=$!
bash docs/device-runs/2026-12-04/grids.sh exact_paper
wait $fp32; cat /tmp/p34_fp32.out  # not a bare wait: that would wait for the test tier too
