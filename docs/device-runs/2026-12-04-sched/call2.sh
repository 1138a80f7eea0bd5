#!/usr/bin/env bash
# nvidia-h200, call 2 of the second 2026-12-04 session: the L2 section size (16 MiB, now the default, against 8 and
# 32) at head_dim 128, then the side-by-side benchmark of both kernels and SDPA on the new defaults. One step after
# another. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-04-sched
timeout 120 python3 $D/probe.py time --rep 50 --shapes 4,16,2048,128 4,16,4096,128 --only "gluon none" sections \
  2>&1 | grep -v Warning | tee $OUT/call2_time.log
timeout 300 python3 -m benchmarks.attention --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --modes fa2/none fa2/fp32_output --atomic-dq --backends triton gluon --rep-ms 40 --out $OUT/call2_bench.md \
  > $OUT/call2_bench.log 2>&1
echo "bench rc=$?"; tail -40 $OUT/call2_bench.md
