#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): what the epilogue's parts cost (epilogue.py: copies of the kernel with parts of
# the epilogue removed, timed against the intact one; wrong outputs, timing only), then the GPU tier on the
# submitted commit, one file after another. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
timeout 200 python3 $D/epilogue.py --shapes 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning \
  | tee $OUT/call2_epilogue.log
L=/tmp/tier_logs; mkdir -p $L
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > /tmp/attention_ids.txt
awk 'NR % 2 == 1' /tmp/attention_ids.txt > /tmp/attention_a.txt
awk 'NR % 2 == 0' /tmp/attention_ids.txt > /tmp/attention_b.txt
set -f
T=${TIER_LIMIT:-200}
timeout $T python3 $D/probe.py check --deterministic > $L/check_det.log 2>&1 &
timeout $T $P tests/gpu/test_attention_gluon_gpu.py > $L/tier_gluon.log 2>&1 &
timeout $T $P $(cat /tmp/attention_a.txt) > $L/tier_attention_a.log 2>&1 &
timeout $T $P $(cat /tmp/attention_b.txt) > $L/tier_attention_b.log 2>&1 &
timeout $T $P tests/gpu/test_train_gpu.py > $L/tier_train.log 2>&1 &
timeout $T $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $L/tier_plan_layouts.log 2>&1 &
wait
set +f
for f in $L/*.log; do echo "== $(basename $f)"; grep -E "^(BAD|ERR|FAILED|ERROR)" $f | head -8; tail -n 1 $f; done \
  | tee $OUT/call2_summary.txt
tar czf $OUT/call2_logs.tgz -C /tmp tier_logs
