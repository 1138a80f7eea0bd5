# nvidia-h200, 2026-12-01 (margin session) call 1: the new kernel paths compile and match the reference
# (tests/gpu/test_attention_gpu.py), and the margin arms' step time with 16 arms sharing the GPU (calibration).
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site
mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/machine.txt
# calibration: 16 arms (2 numerics x 2 signs x 4 seeds, gain 20), 300 steps, in the background
setsid nohup python3 -m launcher.margin margin "margin.numerics=[paper/none,fa2/stochastic_output]" \
  "margin.gains=[20]" "margin.seeds=[1,2,3,4]" run.max_steps=300 run.experiment=calib margin.budget_minutes=0 \
  > $OUT/calib.log 2>&1 &
timeout 330 python3 -m pytest tests/gpu/test_attention_gpu.py -x -q -p no:cacheprovider > $OUT/gpu_attention_tests.log 2>&1
echo "attention tests rc=$?"; tail -5 $OUT/gpu_attention_tests.log
sleep 5; tail -4 $OUT/calib.log; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv
