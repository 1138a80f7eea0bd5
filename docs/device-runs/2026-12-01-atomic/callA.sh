# nvidia-h200, call A: Transformer Engine and DeepSpeed installed (chunks sent by the four calls before), then the
# single-GPU tier on the final code: the attention, training and layout test files side by side.
export PYTHONUNBUFFERED=1
cp .devcache/te.whl.04 /tmp/te/ && source .devcache/install.sh > $OUT/te_install.log 2>&1; set +e
tail -1 $OUT/te_install.log
mkdir -p /tmp/gpu
for f in attention train layouts; do
  setsid nohup timeout 420 python3 -m pytest tests/gpu/test_${f}_gpu.py -rA -p no:cacheprovider \
    --junitxml=$OUT/junit_$f.xml > /tmp/gpu/tests_$f.log 2>&1 &
done
for i in $(seq 90); do pgrep -f "pytest tests/gpu" > /dev/null || break; sleep 5; done
for f in attention train layouts; do
  grep -v "^PASSED" /tmp/gpu/tests_$f.log | tail -c 200000 > $OUT/tests_$f.log; echo "== $f"; tail -3 /tmp/gpu/tests_$f.log
done
