#!/usr/bin/env bash
# nvidia-h200, call 3 of 2026-12-03: the final kernel code (2f551af's backward, the 2026-12-02 forward): the Gluon
# GPU tests, then the side-by-side benchmark of both kernels in one run. One step after another.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-03-gluon
git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call3_gpu_gluon.log 2>&1
echo "gluon tests rc=$?"; tail -2 $OUT/call3_gpu_gluon.log
timeout 200 python3 -m benchmarks.attention --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --modes fa2/none fa2/fp32_output --atomic-dq --backends triton gluon --rep-ms 40 --out $OUT/call3_bench.md \
  > $OUT/call3_bench.log 2>&1
echo "bench rc=$?"; tail -32 $OUT/call3_bench.md
