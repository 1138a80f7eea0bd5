#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): the GPU tier on the commit that is submitted (no Transformer Engine on the
# machine: its FP8 tests skip, and say so), side by side with the probe's fp64 check of every Gluon case
# (deterministic dQ, bit-equal repeat); then GPU time of the submitted default against SDPA cuDNN at the issue's
# three shapes. Logs in $OUT (8 files).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; git log -1 --format=%H 2>/dev/null;
  sha256sum kernels/*.py; } > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > /tmp/attention_ids.txt
awk 'NR % 2 == 1' /tmp/attention_ids.txt > /tmp/attention_a.txt
awk 'NR % 2 == 0' /tmp/attention_ids.txt > /tmp/attention_b.txt
set -f  # test ids contain brackets: no globbing
T=${TIER_LIMIT:-240}
timeout $T python3 $D/probe.py check --deterministic > $OUT/call2_check_det.log 2>&1 &
timeout $T $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_tier_gluon.log 2>&1 &
timeout $T $P $(cat /tmp/attention_a.txt) > $OUT/call2_tier_attention_a.log 2>&1 &
timeout $T $P $(cat /tmp/attention_b.txt) > $OUT/call2_tier_attention_b.log 2>&1 &
timeout $T $P tests/gpu/test_train_gpu.py > $OUT/call2_tier_train.log 2>&1 &
timeout $T $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $OUT/call2_tier_plan_layouts.log 2>&1 &
wait
set +f
for f in $OUT/call2_check_det.log $OUT/call2_tier_*.log; do echo "== $(basename $f)"; grep -E "^(BAD|ERR|FAILED|ERROR)" $f | head -8; tail -n 1 $f; done
timeout 170 python3 $D/probe.py time --rep 25 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon none atomic" "gluon fp32_output" 2>&1 | grep -v Warning | tee $OUT/call2_time.log
