source .devcache/install.sh > /dev/null 2>&1 || exit 1
export PYTHONUNBUFFERED=1
set -o pipefail
mkdir -p $OUT/logs
timeout 500 python3 -m pytest tests/gpu/test_train_gpu.py tests/gpu/test_layouts_gpu.py -q -p no:cacheprovider -rs --tb=short -k "fp8 and not tp2"   > $OUT/logs/gpu_tests_fp8_2.log 2>&1; grep -E "passed|failed|^FAILED|^E  " $OUT/logs/gpu_tests_fp8_2.log | head -30
