# nvidia-h200, call 2: per-launch GPU times after the power-of-two scale shortcut (paper, bf16, head_dim 16/64),
# the attention benchmark at the three shapes, then the GPU tests of the paper modes.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set +e
timeout 150 python3 docs/device-runs/2026-12-01-paper/paper_launches.py 8,12,1024,64 4,16,4096,128 \
  > $OUT/launches.log 2>&1; echo "launches rc $?"; cat $OUT/launches.log
timeout 240 python3 -m benchmarks.attention --shapes 4,16,4096,128 2,16,4096,128 8,12,1024,64 \
  --modes fa2/none fa2/fp32_output paper/none --rep-ms 40 --out $OUT/attention.md > $OUT/attention.log 2>&1
echo "attention rc $?"; cat $OUT/attention.md
timeout 150 python3 -m pytest -q -x tests/gpu/test_attention_gpu.py -k paper > $OUT/gpu_paper_tests.log 2>&1
echo "tests rc $?"; tail -3 $OUT/gpu_paper_tests.log
