#!/usr/bin/env bash
# nvidia-h200, call 1 of 2026-12-03: the forward with the pinned PV wait (kernels/gluon_flash.py _wait_after) against
# ptxas's own placement, both in one run and next to SDPA cuDNN; then its numerics against fp64 (both dQ orders), the
# Gluon GPU tests, and the side-by-side benchmark of both kernels. One step after another (no sharing of the GPU
# while timing). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-03-gluon
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 170 python3 $D/probe.py time --only gluon --rep 50 2>&1 | tee $OUT/call1_time.log | grep -v Warning
timeout 60 python3 $D/probe.py check 2>&1 | tail -20 > $OUT/call1_check_atomic.log; tail -1 $OUT/call1_check_atomic.log
timeout 60 python3 $D/probe.py check --deterministic 2>&1 | tail -20 > $OUT/call1_check_det.log; tail -1 $OUT/call1_check_det.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call1_gpu_gluon.log 2>&1
echo "gluon tests rc=$?"; tail -2 $OUT/call1_gpu_gluon.log
timeout 120 python3 -m benchmarks.attention --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --modes fa2/none fa2/fp32_output --atomic-dq --backends triton gluon --rep-ms 40 --out $OUT/call1_bench.md \
  > $OUT/call1_bench.log 2>&1
echo "bench rc=$?"; tail -30 $OUT/call1_bench.log
