# nvidia-h200, 2026-12-01 call 2: GPU kernel tests (launch hooks fix, top-2 tie test), host overhead, attention
# speed in every mode, training speed with a profile of each side
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .devcache/whl/*.whl | grep -v transformer_engine) > /dev/null 2>&1
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
mkdir -p $OUT/logs $OUT/prof
timeout 150 python3 -m pytest tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -rs --tb=short > $OUT/logs/gpu_attention_tests.log 2>&1
tail -3 $OUT/logs/gpu_attention_tests.log; grep -E "^E  " $OUT/logs/gpu_attention_tests.log | head -5
timeout 60 python3 -m benchmarks.host_overhead --out $OUT/logs/host_overhead.md > $OUT/logs/host_overhead.log 2>&1; cat $OUT/logs/host_overhead.md
timeout 130 python3 -m benchmarks.attention --shapes 8,12,1024,64 16,12,1024,64 4,16,4096,128 --rep-ms 100 --out $OUT/logs/attention.md > $OUT/logs/attention.log 2>&1; cat $OUT/logs/attention.md; grep breakdown $OUT/logs/attention.log | cut -c1-330
timeout 260 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 arms.baseline.attention.rounding=fa2 arms.baseline.attention.fix=dynamic_max run.compile=true --steps 7 --skip 3 --also "arms.baseline.attention.fix=none" --also "attention.backend=sdpa arms.baseline.attention.fix=none" --profile $OUT/prof --json $OUT/logs/train_speed.json > $OUT/logs/train_speed.log 2>&1
tail -28 $OUT/logs/train_speed.log
cd $OUT && tar czf device_out.tgz logs prof && cd - > /dev/null
