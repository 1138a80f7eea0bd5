#!/usr/bin/env bash
# Call 3 of 2026-12-05: (1) the dQ writer (TMA reduce-add) against the register adds, both dQ orders, with the
# Triton kernel and SDPA cuDNN, in one run alone on the GPU (call 2's register rows failed to compile: a static
# branch was missing); (2) the GPU tests that touch the changed code, side by side: the Gluon kernel's file, the
# trainer's and planner's files (no Transformer Engine: their FP8 tests skip) and the Triton kernel's file.
# Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-05-writer
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/call3_machine.txt
timeout 200 python3 $D/probe.py time --rep 50 2>&1 | grep -v Warning | tee $OUT/call3_time.log
P="python3 -m pytest -q -p no:cacheprovider -rs"
timeout 210 $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call3_gpu_gluon.log 2>&1 &
timeout 210 $P tests/gpu/test_train_gpu.py tests/gpu/test_plan_gpu.py > $OUT/call3_gpu_train.log 2>&1 &
timeout 210 $P tests/gpu/test_attention_gpu.py > $OUT/call3_gpu_triton.log 2>&1 &
wait
for f in $OUT/call3_gpu_*.log; do echo "== $f"; tail -4 $f; done
