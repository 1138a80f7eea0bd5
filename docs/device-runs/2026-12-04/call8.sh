#!/usr/bin/env bash
# nvidia-h200: issue 34's exact_fa2 grid (grids.sh, the probe every 100 steps), then the GPU tier's logs that
# call7.sh started (waits for them).
PROBE=100 bash docs/device-runs/2026-12-04/grids.sh exact_fa2
for i in $(seq 60); do [ -f /tmp/gputier/done ] && break; sleep 5; done
cp /tmp/gputier/*.log /tmp/gputier/commit.txt $OUT/ 2>/dev/null; ls /tmp/gputier
for f in gluon attention train; do echo "== $f"; tail -3 /tmp/gputier/gpu_$f.log; done
