# device call 6 (warm nvidia-h200-x2, TE installed): the one-GPU trainer tests, then 1.3B FP8 vs BF16 and PP2/TP2 throughput
source .devcache/install.sh > /dev/null || exit 1
set +e
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 200 python3 -m pytest tests/gpu/test_train_gpu.py -v -p no:cacheprovider -rs --tb=short -k "fp8 or holds or resumes" \
  > $OUT/logs/gpu_train_fp8.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/logs/gpu_train_fp8.log | head -20
B="python3 -m benchmarks.layouts gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64 --steps 6 --skip 2"
timeout 90 $B precision.fp8_ffn=false --layouts single --json $OUT/logs/layouts_1p3b_bf16.json > $OUT/logs/layouts_1p3b_bf16.log 2>&1
tail -4 $OUT/logs/layouts_1p3b_bf16.log
timeout 200 $B --layouts single,pp2,tp2 --json $OUT/logs/layouts_1p3b_fp8.json > $OUT/logs/layouts_1p3b_fp8.log 2>&1
tail -6 $OUT/logs/layouts_1p3b_fp8.log
