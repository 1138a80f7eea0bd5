# nvidia-h200, 2026-12-01 (house session) call 4: the whole single-GPU test tier on the final commit, three pytest
# processes side by side, with Transformer Engine and DeepSpeed from call 3 and no `datasets` (the embedded corpus
# needs none now).
export PYTHONUNBUFFERED=1
source .devcache/install.sh > /dev/null 2>&1; set +e  # install.sh sets -e
mkdir -p $OUT /tmp/gpu
python3 -c "import datasets" 2>/dev/null && echo "datasets IS installed" || echo "no datasets module (as intended)"
git log --oneline -1
for f in attention train layouts; do
  setsid nohup timeout 540 python3 -m pytest tests/gpu/test_${f}_gpu.py -rA -p no:cacheprovider \
    --junitxml=$OUT/junit_$f.xml > /tmp/gpu/tests_$f.log 2>&1 &
done
for i in $(seq 110); do pgrep -f "pytest tests/gpu" > /dev/null || break; sleep 5; done
for f in attention train layouts; do
  grep -v "^PASSED" /tmp/gpu/tests_$f.log | tail -c 200000 > $OUT/tests_$f.log; echo "== $f"; tail -4 /tmp/gpu/tests_$f.log
done
