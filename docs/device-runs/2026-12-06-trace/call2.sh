#!/usr/bin/env bash
# Call 2 of 2026-12-06 (trace): the forward's PV wait held after the softmax (FWD_PIN_PV_WAIT, now the default).
# (1) the SM-clock trace of ptxas's wait, the held wait, and the held wait with ping-pong; (2) GPU time of the held
# wait against ptxas's, both dQ orders, next to SDPA cuDNN; (3) side by side, correctness and the single-GPU tier
# (no Transformer Engine on the machine: its FP8 tests skip): the probe's fp64 check of every Gluon case (ordered dQ,
# bit-equal repeat), the Gluon GPU file, the Triton kernel's file in two halves, the trainer file, plan and layouts.
# Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
python3 $D/make_trace_kernel.py  # gluon_trace.py: the stamped copy of this tree's kernels/gluon_flash.py
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py $D/gluon_trace.py; } > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
mkdir -p /tmp/traces
timeout 150 python3 $D/trace.py run --out /tmp/traces --shapes 4,16,4096,128 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning | tee $OUT/call2_run.log
python3 $D/trace.py show /tmp/traces/trace_*.pt > $OUT/call2_show.txt 2>&1
grep -E "^==|step|lag|softmax|issue" $OUT/call2_show.txt
tar czf $OUT/call2_traces.tgz -C /tmp traces
timeout 150 python3 $D/probe.py time --rep 30 --shapes 4,16,2048,128 4,16,4096,128 8,12,1024,64 --only gluon 2>&1 \
  | grep -v Warning | tee $OUT/call2_time.log
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
$P --collect-only tests/gpu/test_attention_gpu.py 2>/dev/null | grep :: > /tmp/attention_ids.txt
awk 'NR % 2 == 1' /tmp/attention_ids.txt > /tmp/attention_a.txt
awk 'NR % 2 == 0' /tmp/attention_ids.txt > /tmp/attention_b.txt
set -f  # test ids contain brackets: no globbing
T=${TIER_LIMIT:-230}
timeout $T python3 $D/probe.py check --deterministic > $OUT/call2_check_det.log 2>&1 &
timeout $T $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_tier_gluon.log 2>&1 &
timeout $T $P $(cat /tmp/attention_a.txt) > $OUT/call2_tier_attention_a.log 2>&1 &
timeout $T $P $(cat /tmp/attention_b.txt) > $OUT/call2_tier_attention_b.log 2>&1 &
timeout $T $P tests/gpu/test_train_gpu.py > $OUT/call2_tier_train.log 2>&1 &
timeout $T $P tests/gpu/test_plan_gpu.py tests/gpu/test_layouts_gpu.py > $OUT/call2_tier_plan_layouts.log 2>&1 &
wait
set +f
for f in $OUT/call2_check_det.log $OUT/call2_tier_*.log; do echo "== $(basename $f)"; grep -E "^(BAD|ERR|FAILED|ERROR)" $f | head -8; tail -n 1 $f; done
