# nvidia-h200, call 4, on commit dbb382b (the _block_qk helper): the whole GPU attention file.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set +e
timeout 320 python3 -m pytest -q tests/gpu/test_attention_gpu.py > $OUT/attention_gpu.log 2>&1
echo "attention rc $?"; tail -3 $OUT/attention_gpu.log
