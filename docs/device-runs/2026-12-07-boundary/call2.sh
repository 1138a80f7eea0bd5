#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): what the epilogue's parts cost (epilogue.py: copies of the kernel with parts of
# the epilogue removed, timed against the intact one; wrong outputs, timing only), then the leaner row division
# and the bf16 O by TMA against the default epilogue (bits, then probe.py time). Logs in $OUT. (The GPU tier was
# dropped from it when the session's device time ran short: it ran in call 1c.)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
timeout 150 python3 $D/epilogue.py --shapes 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning \
  | tee $OUT/call2_epilogue.log
# the leaner row division (the range test on the bits of |a|, after call 1b) and the bf16 O by TMA (FWD_O_TMA,
# added before this call ran): their bits against the default (same_bits.py; V scaled by 2^-70 and 2^66 sends
# tiles to the row division's fallback), then their time against it. (The GPU test of both, in
# tests/gpu/test_attention_gluon_gpu.py, runs with the GPU tier on the final commit.)
timeout 200 python3 docs/device-runs/2026-12-06-trace/same_bits.py "row divide" "O by TMA" 2>&1 | grep -v Warning \
  > $OUT/call2_same_bits.log; grep -c "^ok" $OUT/call2_same_bits.log; grep "^BAD" $OUT/call2_same_bits.log | head -5
tail -n 1 $OUT/call2_same_bits.log
timeout 200 python3 $D/probe.py time --rep 20 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon element divide none atomic" "gluon row divide none atomic" "gluon O by TMA none atomic" \
  "gluon element divide fp32_output det" "gluon row divide fp32_output det" "gluon O by TMA fp32_output det" \
  2>&1 | grep -v Warning | tee $OUT/call2_time.log
