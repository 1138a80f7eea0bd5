#!/usr/bin/env bash
# nvidia-h200, call 2 of 2026-12-03: the Gluon backward with its dQ writer warp (kernels/gluon_flash.py
# _bwd_dq_writer): numerics against fp64 (both dQ orders, the ordered one bit for bit twice), the Gluon GPU tests,
# its time against the backward of commit 2f551af (compute warps adding dQ themselves) and SDPA cuDNN, then the
# side-by-side benchmark of both kernels with the harness's fresh-leaf capture. One step after another.
# Needs .devcache/gluon_flash_2f551af.py (git show 2f551af:kernels/gluon_flash.py), carried to the device.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-03-gluon
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 70 python3 $D/probe.py check 2>&1 | tail -20 > $OUT/call2_check_atomic.log; tail -1 $OUT/call2_check_atomic.log
timeout 70 python3 $D/probe.py check --deterministic 2>&1 | tail -20 > $OUT/call2_check_det.log; tail -1 $OUT/call2_check_det.log
timeout 150 python3 $D/probe.py time --only gluon --rep 50 2>&1 | grep -v Warning | tee $OUT/call2_time.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_gpu_gluon.log 2>&1
echo "gluon tests rc=$?"; tail -2 $OUT/call2_gpu_gluon.log
timeout 170 python3 -m benchmarks.attention --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --modes fa2/none fa2/fp32_output --atomic-dq --backends triton gluon --rep-ms 40 --out $OUT/call2_bench.md \
  > $OUT/call2_bench.log 2>&1
echo "bench rc=$?"; tail -40 $OUT/call2_bench.log | cut -c1-400
