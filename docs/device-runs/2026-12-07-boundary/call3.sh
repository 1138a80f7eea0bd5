#!/usr/bin/env bash
# Call 3 of 2026-12-07 (boundary), third session, on commit 1e10830 (FWD_O_TMA on), the machine of call 2 still warm:
# the bf16 O by TMA's bits against plain stores (same_bits.py, beside the GPU tier) and the GPU tier. Its last line
# (the time probe) ran in /tmp/tier after the `cd` of the tar step and found no probe.py: it timed nothing (call 4
# did). The `git log` line wrote a stale commit on the device (its copy's .git was older than the tree), so
# call3_commit.txt is not kept.
export PYTHONPATH=. TRITON_DEFAULT_FP_FUSION=1; git log --oneline | head -1 > $OUT/call3_commit.txt; (timeout 250 python3 docs/device-runs/2026-12-06-trace/same_bits.py "O by TMA" > $OUT/call3_same_bits.log 2>&1 &); bash docs/device-runs/gpu_tier.sh /tmp/tier 250 2>&1 | tee $OUT/call3_summary.txt; sleep 5; tail -n 2 $OUT/call3_same_bits.log; grep -c "^ok" $OUT/call3_same_bits.log; cd /tmp/tier && tar czf $OUT/call3_logs.tgz *.log; timeout 150 python3 docs/device-runs/2026-12-07-boundary/probe.py time --rep 20 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 --only "gluon O by TMA none atomic" "gluon O by TMA fp32_output det" "gluon O by TMA none det" 2>&1 | grep -v Warning | tee $OUT/call3_time.log
