#!/usr/bin/env bash
# nvidia-h200, call 1 of 2026-12-05: the backward's dQ writer warp (TMA reduce-add) against the register adds of
# 2026-12-04, timed in one run alone on the GPU; then both backwards' numerics against fp64 in both dQ orders and
# the Gluon GPU tests, side by side. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-05-writer
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 120 python3 $D/probe.py check --deterministic > $OUT/call1_check_det.log 2>&1
rc=$?; grep -v Warning $OUT/call1_check_det.log | tail -30
[ $rc = 124 ] && { echo "check timed out (a hang?): stopping"; exit 1; }
timeout 240 python3 $D/probe.py time --rep 50 2>&1 | grep -v Warning | tee $OUT/call1_time.log
timeout 200 python3 $D/probe.py check > $OUT/call1_check_atomic.log 2>&1 &
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call1_gpu_gluon.log 2>&1 &
wait
grep -v Warning $OUT/call1_check_atomic.log | tail -30
tail -15 $OUT/call1_gpu_gluon.log
