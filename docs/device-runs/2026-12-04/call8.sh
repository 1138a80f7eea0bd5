#!/usr/bin/env bash
# nvidia-h200: call 7's exact_paper and exact_paper_fp32 arms continued from their checkpoints (margin.max_minutes
# stopped them) beside issue 34's exact_fa2 grid (the probe every 100 steps), then the GPU tier's logs that
# call7.sh started in the background.
MAX_MINUTES=4 bash docs/device-runs/2026-12-04/grids.sh exact_paper > /tmp/c8_paper.out 2>&1 &
p=$!
MAX_MINUTES=4 bash docs/device-runs/2026-12-04/grids.sh exact_paper_fp32 > /tmp/c8_fp32.out 2>&1 &
f=$!
MAX_MINUTES=7.5 PROBE=100 bash docs/device-runs/2026-12-04/grids.sh exact_fa2
wait $p $f; cat /tmp/c8_paper.out /tmp/c8_fp32.out
for i in $(seq 10); do [ -f /tmp/gputier/done ] && break; sleep 3; done
cp /tmp/gputier/*.log /tmp/gputier/commit.txt $OUT/ 2>/dev/null; ls /tmp/gputier
for f in gluon attention train; do echo "== $f"; tail -3 /tmp/gputier/gpu_$f.log; done
