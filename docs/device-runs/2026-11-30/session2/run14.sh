# device call 5 of a fresh nvidia-h200-x2 (after the four chunk calls): install TE, FP8 layout tests, 1.3B benchmarks
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh || exit 1
export PYTHONUNBUFFERED=1
set -o pipefail
mkdir -p $OUT/logs
echo "commit 16c48f7" > $OUT/logs/machine.txt; nvidia-smi -L >> $OUT/logs/machine.txt
timeout 150 python3 -m pytest tests/gpu/test_layouts_gpu.py -q -p no:cacheprovider -rs --tb=short   -k "fp8 and (pp2 or zero1)" > $OUT/logs/gpu_tests_fp8_layouts.log 2>&1
grep -E "passed|failed|^FAILED|^E  |timed out" $OUT/logs/gpu_tests_fp8_layouts.log | head -20
timeout 80 python3 -m benchmarks.layouts gpt_1p3b_fp8 precision.fp8_ffn=false data.data_dir=data/cache/kjv   data.global_batch_size=64 --layouts single --steps 6 --skip 2 --json $OUT/logs/layouts_1p3b_bf16.json   > $OUT/logs/layouts_1p3b_bf16.log 2>&1
tail -3 $OUT/logs/layouts_1p3b_bf16.log
timeout 175 python3 -m benchmarks.layouts gpt_1p3b_fp8 data.data_dir=data/cache/kjv data.global_batch_size=64   --layouts single,pp2,tp2 --steps 6 --skip 2 --json $OUT/logs/layouts_1p3b_fp8.json > $OUT/logs/layouts_1p3b_fp8.log 2>&1
tail -6 $OUT/logs/layouts_1p3b_fp8.log
