#!/usr/bin/env bash
# Call 4 of 2026-12-05: the GPU tests that touch the changed code, side by side: the Gluon kernel's file, the
# trainer's file (no Transformer Engine: its FP8 tests skip) and the Triton kernel's file. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
P="python3 -m pytest -q -p no:cacheprovider -rs"
timeout 400 $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call4_gpu_gluon.log 2>&1 &
timeout 400 $P tests/gpu/test_train_gpu.py tests/gpu/test_plan_gpu.py > $OUT/call4_gpu_train.log 2>&1 &
timeout 400 $P tests/gpu/test_attention_gpu.py > $OUT/call4_gpu_triton.log 2>&1 &
wait
for f in $OUT/call4_*.log; do echo "== $f"; tail -4 $f; done
