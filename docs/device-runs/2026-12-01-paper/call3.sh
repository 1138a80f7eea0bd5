# nvidia-h200, call 3, on commit 3b003ba (the session's last kernel change): the whole GPU attention file and the
# trainer's GPU file side by side (Transformer Engine not installed: the FP8 tests of test_train_gpu.py skip).
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set +e
setsid timeout 400 python3 -m pytest -q tests/gpu/test_train_gpu.py -rs > $OUT/train_gpu.log 2>&1 &
timeout 400 python3 -m pytest -q tests/gpu/test_attention_gpu.py > $OUT/attention_gpu.log 2>&1
echo "attention rc $?"; tail -3 $OUT/attention_gpu.log
wait; tail -12 $OUT/train_gpu.log
