#!/usr/bin/env bash
# nvidia-h200, call 1 of the second 2026-12-04 session: the forward's dynamic schedule and L2 sections and the
# backward's dQ-under-dK order, timed against the 2026-12-03 kernel in one run (alone on the GPU), then their
# numerics against fp64 in both dQ orders and the Gluon GPU tests (these three side by side). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-04-sched
git log --oneline -1 2>/dev/null
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 240 python3 $D/probe.py time --rep 50 2>&1 | grep -v Warning | tee $OUT/call1_time.log
timeout 200 python3 $D/probe.py check > $OUT/call1_check_atomic.log 2>&1 &
timeout 200 python3 $D/probe.py check --deterministic > $OUT/call1_check_det.log 2>&1 &
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call1_gpu_gluon.log 2>&1 &
wait
grep -v Warning $OUT/call1_check_atomic.log | tail -12; grep -v Warning $OUT/call1_check_det.log | tail -12
tail -15 $OUT/call1_gpu_gluon.log
