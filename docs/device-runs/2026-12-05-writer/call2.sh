#!/usr/bin/env bash
# Call 2 of 2026-12-05, as it ran (one command line, written out here for the record): call 1's machine, warm;
# the timing alone on the GPU, then both checks and the Gluon GPU file side by side. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1; D=docs/device-runs/2026-12-05-writer
timeout 270 python3 $D/probe.py time --rep 50 2>&1 | grep -v Warning | tee $OUT/call2_time.log
(timeout 200 python3 $D/probe.py check > $OUT/call2_check_atomic.log 2>&1 &)
(timeout 200 python3 $D/probe.py check --deterministic > $OUT/call2_check_det.log 2>&1 &)
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call2_gpu_gluon.log 2>&1
sleep 5; grep -v Warning $OUT/call2_check_atomic.log | tail -9; grep -v Warning $OUT/call2_check_det.log | tail -9
tail -8 $OUT/call2_gpu_gluon.log
