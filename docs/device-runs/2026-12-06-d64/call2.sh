#!/usr/bin/env bash
# Call 2 of 2026-12-06 (on the final commit of the session): the single-GPU test tier, without Transformer Engine
# (its install no longer fitted the session's device time: its FP8 tests skip), five pytest processes
# side by side (a correctness tier: sharing the GPU changes its time, not its results): the Gluon kernel's file,
# the Triton kernel's file in two halves (its tests in collection order, alternately), the trainer file, the plan
# and layout files. Logs in $OUT.
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
{ git log --oneline -1; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; } > $OUT/call2_commit.txt
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > /tmp/attention_ids.txt
awk 'NR % 2 == 1' /tmp/attention_ids.txt > /tmp/attention_a.txt
awk 'NR % 2 == 0' /tmp/attention_ids.txt > /tmp/attention_b.txt
echo "attention tests: $(wc -l < /tmp/attention_a.txt) + $(wc -l < /tmp/attention_b.txt)"
set -f  # test ids contain brackets: no globbing
T=${TIER_LIMIT:-480}
timeout $T $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_tier_gluon.log 2>&1 &
timeout $T $P $(cat /tmp/attention_a.txt) > $OUT/call2_tier_attention_a.log 2>&1 &
timeout $T $P $(cat /tmp/attention_b.txt) > $OUT/call2_tier_attention_b.log 2>&1 &
timeout $T $P tests/gpu/test_train_gpu.py > $OUT/call2_tier_train.log 2>&1 &
timeout $T $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $OUT/call2_tier_plan_layouts.log 2>&1 &
wait
set +f
for f in $OUT/call2_tier_*.log; do echo "== $(basename $f)"; grep -E "^(FAILED|ERROR|SKIPPED)" $f | head -12; tail -n 1 $f; done
