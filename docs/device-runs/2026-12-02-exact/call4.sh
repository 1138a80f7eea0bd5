#!/usr/bin/env bash
# nvidia-h200, this session's last call: the single-GPU test tier on the final code, three pytest processes at once
# (the Gluon kernel's file, the Triton kernel's file, the trainer / plan / layout files). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
P="python3 -m pytest -q -p no:cacheprovider -rs"
timeout 540 $P tests/gpu/test_attention_gluon_gpu.py > $OUT/gpu_gluon.log 2>&1 &
g=$!
timeout 540 $P tests/gpu/test_attention_gpu.py > $OUT/gpu_attention.log 2>&1 &
a=$!
timeout 540 $P tests/gpu/test_train_gpu.py tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $OUT/gpu_train.log 2>&1 &
t=$!
wait $g; echo "gluon rc=$?"; tail -2 $OUT/gpu_gluon.log
wait $a; echo "attention rc=$?"; tail -2 $OUT/gpu_attention.log
wait $t; echo "train rc=$?"; tail -2 $OUT/gpu_train.log
