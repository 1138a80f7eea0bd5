source .devcache/install.sh > /dev/null || exit 1
set +e
export PYTHONUNBUFFERED=1
mkdir -p $OUT/logs
timeout 240 python3 -m pytest tests/gpu/test_train_gpu.py -v -p no:cacheprovider -rs --tb=short -k "compiled" > $OUT/logs/gpu_compile_modes.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E  " $OUT/logs/gpu_compile_modes.log | head -20
timeout 250 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 arms.baseline.attention.rounding=fa2 arms.baseline.attention.fix=dynamic_max run.compile=true --steps 10 --skip 4 --json $OUT/logs/train_speed_gpt2.json > $OUT/logs/train_speed_gpt2.log 2>&1
tail -8 $OUT/logs/train_speed_gpt2.log
