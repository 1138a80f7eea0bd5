#!/usr/bin/env bash
# Call 3 of 2026-12-06 (trace), prepared and NOT run (the session's device time ran out): two Q slots per consumer
# in the Gluon forward (FWD_Q_SLOTS = 2, probe variant "gluon 2 Q slots": the next tile's Q loads while this tile
# runs; the FP32 O by plain stores at head_dim 128, where the second slot takes the buffers' shared memory).
# (1) same bits as one slot (same_bits.py); (2) the clock trace of both (the query-tile boundaries); (3) GPU time
# against one slot (the default), next to SDPA cuDNN; (4) the Gluon GPU test file, in what time is left. Logs in
# $OUT (at most 8 files come back).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } > $OUT/call3_machine.txt
head -1 $OUT/call3_machine.txt
timeout 40 python3 $D/same_bits.py 2>&1 | grep -v Warning > $OUT/call3_same_bits.log; grep -E "BAD|same_bits" $OUT/call3_same_bits.log
python3 $D/make_trace_kernel.py  # gluon_trace.py: the stamped copy of this tree's kernels/gluon_flash.py
timeout 90 python3 $D/trace.py run --out /tmp/traces --shapes 8,12,1024,64 4,16,2048,128 2>&1 | grep -v Warning \
  | tee $OUT/call3_trace_run.log
python3 $D/trace.py show /tmp/traces/trace_*.pt > $OUT/call3_show.txt 2>&1; grep -E "^==|step|boundary" $OUT/call3_show.txt
timeout 90 python3 $D/probe.py time --rep 25 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "none atomic" "fp32_output det" 2>&1 | grep -v Warning | tee $OUT/call3_time.log
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -x tests/gpu/test_attention_gluon_gpu.py > $OUT/call3_gpu_gluon.log 2>&1
tail -n 2 $OUT/call3_gpu_gluon.log
