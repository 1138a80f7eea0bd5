# device call 5 of a fresh nvidia-h200-x2 (after the four chunk calls): install TE + DeepSpeed, then the two-GPU layout tests
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh || exit 1
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
echo "commit 0a75673" > $OUT/logs/machine.txt; nvidia-smi -L >> $OUT/logs/machine.txt
timeout 270 python3 -m pytest tests/gpu/test_layouts_gpu.py -v -p no:cacheprovider -rs --tb=short -k "fp8 and not tp2" \
  > $OUT/logs/gpu_layouts_fp8.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/logs/gpu_layouts_fp8.log | head -20
timeout 190 python3 -m pytest tests/gpu/test_layouts_gpu.py -v -p no:cacheprovider -rs --tb=short -k "not fp8" \
  > $OUT/logs/gpu_layouts_bf16.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/logs/gpu_layouts_bf16.log | head -20
