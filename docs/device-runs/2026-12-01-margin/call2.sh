# nvidia-h200, 2026-12-01 (margin session) call 2: training speed of the fixes (alone on the GPU), then the default
# margin grid in the background while the single-GPU test tier runs beside it. call3.sh waits for the grid.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
git log --oneline -1 >> $OUT/machine.txt
timeout 230 python3 -m benchmarks.train_speed gpt2_small_paper data.data_dir=data/cache/kjv model.vocab_size=50304 \
  arms.baseline.attention.rounding=fa2 arms.baseline.attention.fix=none run.compile=true \
  --also "arms.baseline.attention.fix=stochastic_output" --also "arms.baseline.attention.fix=fp32_output" \
  --baselines cudnn --steps 6 --skip 2 --json $OUT/train_speed.json > $OUT/train_speed.log 2>&1
echo "train_speed rc=$?"; tail -8 $OUT/train_speed.log
setsid nohup python3 -m launcher.margin margin margin.max_minutes=12.5 > /tmp/margin.log 2>&1 &
timeout 300 python3 -m pytest tests/gpu/test_attention_gpu.py tests/gpu/test_train_gpu.py -q -p no:cacheprovider \
  > $OUT/gpu_tests.log 2>&1
echo "gpu tests rc=$?"; tail -12 $OUT/gpu_tests.log
tail -3 /tmp/margin.log
