# nvidia-h200, 2026-12-01 call 5: training speed against baselines that really use flash and cuDNN
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .devcache/whl/*.whl | grep -v transformer_engine) > /dev/null 2>&1
export PYTHONPATH=/tmp/site TORCH_CUDA_ARCH_LIST=9.0
mkdir -p $OUT/logs $OUT/prof
timeout 200 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 arms.baseline.attention.rounding=fa2 arms.baseline.attention.fix=dynamic_max run.compile=true --steps 6 --skip 2 --profile $OUT/prof --json $OUT/logs/train_speed.json > $OUT/logs/train_speed.log 2>&1
tail -20 $OUT/logs/train_speed.log
cd $OUT && tar czf device_out.tgz logs prof && cd - > /dev/null
