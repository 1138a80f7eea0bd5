# nvidia-h200, 2026-12-01 call 1: kernel tests on the new layout + cached launch, host overhead, attention speed,
# tile sweep, training speed with a profile
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .devcache/whl/*.whl | grep -v transformer_engine) > /dev/null 2>&1
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
mkdir -p $OUT/logs $OUT/prof
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/logs/machine.txt; nproc >> $OUT/logs/machine.txt
timeout 170 python3 -m pytest tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -rs --tb=short > $OUT/logs/gpu_attention_tests.log 2>&1
tail -4 $OUT/logs/gpu_attention_tests.log
timeout 60 python3 -m benchmarks.host_overhead --out $OUT/logs/host_overhead.md > $OUT/logs/host_overhead.log 2>&1; cat $OUT/logs/host_overhead.md
timeout 60 python3 -m benchmarks.host_overhead --shape 8,12,1024,64 --mode fa2/none --calls 300 > $OUT/logs/host_overhead_1024.log 2>&1; grep "|" $OUT/logs/host_overhead_1024.log
timeout 120 python3 -m benchmarks.attention --shapes 8,12,1024,64 16,12,1024,64 4,16,4096,128 --modes fa2/none fa2/dynamic_max fa2/fp32_output paper/none --rep-ms 100 --out $OUT/logs/attention.md > $OUT/logs/attention.log 2>&1; cat $OUT/logs/attention.md; grep breakdown $OUT/logs/attention.log
timeout 150 python3 -m benchmarks.attention_tiles --shape 16,12,1024,64 --mode fa2/none --jobs 14 --out $OUT/logs/tiles_16_1024.md > $OUT/logs/tiles.log 2>&1; cat $OUT/logs/tiles_16_1024.md | head -60
tail -3 $OUT/logs/tiles.log
cd $OUT && tar czf device_out.tgz logs prof && cd - > /dev/null
