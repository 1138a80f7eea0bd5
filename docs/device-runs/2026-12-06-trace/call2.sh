#!/usr/bin/env bash
# Call 2 of 2026-12-06 (trace): the forward's PV wait held after the softmax (FWD_PIN_PV_WAIT, now the default).
# (1) side by side, correctness: the probe's fp64 check of every Gluon case (ordered dQ, bit-equal repeat) and the
# Gluon GPU test file; (2) the SM-clock trace of ptxas's wait, the held wait, and the held wait with ping-pong;
# (3) GPU time of the held wait against ptxas's, both dQ orders, next to SDPA cuDNN. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
python3 $D/make_trace_kernel.py  # gluon_trace.py: the stamped copy of this tree's kernels/gluon_flash.py
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/gluon_flash.py $D/gluon_trace.py; } | tee $OUT/call2_machine.txt
timeout 240 python3 $D/probe.py check --deterministic > $OUT/call2_check_det.log 2>&1 &
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_gpu_gluon.log 2>&1 &
wait
for f in $OUT/call2_check_det.log $OUT/call2_gpu_gluon.log; do echo "== $f"; grep -E "^(BAD|ERR|FAILED)" $f | head; tail -2 $f; done
mkdir -p /tmp/traces
timeout 200 python3 $D/trace.py run --out /tmp/traces --shapes 4,16,4096,128 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning | tee $OUT/call2_run.log
python3 $D/trace.py show /tmp/traces/trace_*.pt > $OUT/call2_show.txt 2>&1
grep -E "^==|step|lag|softmax|issue" $OUT/call2_show.txt
tar czf $OUT/call2_traces.tgz -C /tmp traces
timeout 200 python3 $D/probe.py time --rep 40 --shapes 4,16,2048,128 4,16,4096,128 8,12,1024,64 --only gluon 2>&1 \
  | grep -v Warning | tee $OUT/call2_time.log
