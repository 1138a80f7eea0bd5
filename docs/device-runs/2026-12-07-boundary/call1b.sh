#!/usr/bin/env bash
# Call 1b of 2026-12-07 (boundary): calls 1 and 2 in one, after starts failed for a quarter of the session's device
# time. The tree has FWD_ROW_DIVIDE on (the submitted default). (1) side by side, limit 240 s each: same bits of the
# row division and of the cross-tile order against the element division (same_bits.py compares with its own explicit
# default), the probe's fp64 check of every Gluon case (ordered dQ, bit-equal repeat), and the GPU tier (no Transformer
# Engine on the machine: its FP8 tests skip); (2) GPU time, fp32_output ordered and fa2/none atomic, each Gluon variant
# next to SDPA cuDNN (170 s); (3) the stamped query-tile boundary, fp32_output (100 s). Six files in $OUT; every
# log is in call1b_logs.tgz, and call1b_summary.txt has the verdict lines.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
L=/tmp/call1b_logs; mkdir -p $L
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call1b_machine.txt
head -1 $OUT/call1b_machine.txt
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > /tmp/attention_ids.txt
awk 'NR % 2 == 1' /tmp/attention_ids.txt > /tmp/attention_a.txt
awk 'NR % 2 == 0' /tmp/attention_ids.txt > /tmp/attention_b.txt
set -f  # test ids contain brackets: no globbing
T=${TIER_LIMIT:-240}
timeout $T python3 docs/device-runs/2026-12-06-trace/same_bits.py "row divide" > $L/same_bits_row_divide.log 2>&1 &
timeout $T python3 docs/device-runs/2026-12-06-trace/same_bits.py "2 Q slots cross-tile" > $L/same_bits_xtile.log 2>&1 &
timeout $T python3 $D/probe.py check --deterministic > $L/check_det.log 2>&1 &
timeout $T $P tests/gpu/test_attention_gluon_gpu.py > $L/tier_gluon.log 2>&1 &
timeout $T $P $(cat /tmp/attention_a.txt) > $L/tier_attention_a.log 2>&1 &
timeout $T $P $(cat /tmp/attention_b.txt) > $L/tier_attention_b.log 2>&1 &
timeout $T $P tests/gpu/test_train_gpu.py > $L/tier_train.log 2>&1 &
timeout $T $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $L/tier_plan_layouts.log 2>&1 &
wait
set +f
for f in $L/*.log; do echo "== $(basename $f)"; grep -E "^(BAD|ERR|FAILED|ERROR)" $f | head -8; tail -n 1 $f; done \
  | tee $OUT/call1b_summary.txt
timeout 170 python3 $D/probe.py time --rep 20 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "divide fp32_output det" "xtile fp32_output det" "gluon element divide none atomic" \
  "gluon row divide none atomic" 2>&1 | grep -v Warning \
  | tee $OUT/call1b_time.log
python3 $D/make_boundary_kernel.py
mkdir -p /tmp/boundary
timeout 100 python3 $D/boundary.py run --out /tmp/boundary --shapes 4,16,2048,128 8,12,1024,64 \
  --fixes fp32_output 2>&1 | grep -v Warning > $L/boundary_run.log
python3 $D/boundary.py show /tmp/boundary/*.pt 2>&1 | tee $OUT/call1b_show.txt
tar czf $OUT/call1b_boundary.tgz -C /tmp boundary
tar czf $OUT/call1b_logs.tgz -C /tmp call1b_logs
