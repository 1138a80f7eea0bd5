# device call 5 (nvidia-h200-x2, warm after 4 chunk calls): install TE, then the FP8 GPU tests
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh || exit 1
export PYTHONUNBUFFERED=1
set -o pipefail
mkdir -p $OUT/logs
echo "commit fee6b82" > $OUT/logs/machine.txt; nvidia-smi -L >> $OUT/logs/machine.txt
timeout 420 python3 -m pytest tests/gpu/test_train_gpu.py tests/gpu/test_layouts_gpu.py -q -p no:cacheprovider -rs -k fp8   2>&1 | tee $OUT/logs/gpu_tests_fp8.log | tail -25
