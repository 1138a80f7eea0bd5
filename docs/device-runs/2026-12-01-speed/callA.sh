# nvidia-h200, 2026-12-01 (speed session) call A: Transformer Engine and DeepSpeed installed (chunks sent by the
# four calls before), then the single-GPU tier on the final kernel: attention and training tests side by side.
export PYTHONUNBUFFERED=1
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh > $OUT/te_install.log 2>&1; set +e
python3 -c "import transformer_engine.pytorch as te, deepspeed; print('TE', te.__version__ if hasattr(te, '__version__') else '?', 'DeepSpeed', deepspeed.__version__)"
mkdir -p /tmp/gpu
for f in attention train layouts; do
  setsid nohup timeout 400 python3 -m pytest tests/gpu/test_${f}_gpu.py -rA -p no:cacheprovider \
    --junitxml=$OUT/junit_$f.xml > /tmp/gpu/tests_$f.log 2>&1 &
done
for i in $(seq 90); do pgrep -f "pytest tests/gpu" > /dev/null || break; sleep 5; done
for f in attention train layouts; do
  grep -v "^PASSED" /tmp/gpu/tests_$f.log | tail -c 200000 > $OUT/tests_$f.log; echo "== $f"; tail -3 /tmp/gpu/tests_$f.log
done
