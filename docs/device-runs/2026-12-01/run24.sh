# nvidia-h200, 2026-12-01 call 4 (final code): GPU kernel tests to completion, attention speed at the long shape
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 260 python3 -m pytest tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -rs --tb=short > $OUT/logs/gpu_attention_tests.log 2>&1
tail -2 $OUT/logs/gpu_attention_tests.log; grep -E "^E  " $OUT/logs/gpu_attention_tests.log | head -5
timeout 120 python3 -m benchmarks.attention --shapes 4,16,4096,128 --modes fa2/none fa2/dynamic_max fa2/dynamic_max_published fa2/fp32_output paper/none --rep-ms 100 --out $OUT/logs/attention_4096.md > $OUT/logs/attention_4096.log 2>&1; cat $OUT/logs/attention_4096.md; tail -1 $OUT/logs/attention_4096.log | cut -c1-300
