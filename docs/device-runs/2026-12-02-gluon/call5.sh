#!/usr/bin/env bash
# The session's last device call: the single-GPU tier on the final commit (the two attention files and the trainer
# file in parallel, then) the attention benchmark alone on the GPU. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
git log --oneline -1 2>/dev/null || true
timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_attention_gpu.py tests/gpu/test_attention_gluon_gpu.py \
    > $OUT/gpu_attention.log 2>&1 &
a=$!
timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu/test_train_gpu.py tests/gpu/test_plan_gpu.py \
    > $OUT/gpu_train.log 2>&1 &
t=$!
wait $a; echo "attention tests rc=$?"; tail -3 $OUT/gpu_attention.log
wait $t; echo "train tests rc=$?"; tail -3 $OUT/gpu_train.log
timeout 180 python -m benchmarks.attention --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 --modes fa2/none fa2/fp32_output \
    --atomic-dq --backends triton gluon --rep-ms 40 --out $OUT/bench.md 2> $OUT/bench.log
echo "bench rc=$?"
