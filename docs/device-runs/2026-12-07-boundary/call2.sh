#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): what the epilogue's parts cost (epilogue.py: copies of the kernel with parts of
# the epilogue removed, timed against the intact one; wrong outputs, timing only), then the leaner row division
# against the element division (bits, then probe.py time). Logs in $OUT. (The GPU tier was
# dropped from it when the session's device time ran short: it ran in call 1c.)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
timeout 150 python3 $D/epilogue.py --shapes 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning \
  | tee $OUT/call2_epilogue.log
# the leaner row division (the range test on the bits of |a|, after call 1b): its bits (same_bits.py and the GPU
# test), then its time against the element division
timeout 150 python3 docs/device-runs/2026-12-06-trace/same_bits.py "row divide" 2>&1 | grep -v Warning \
  > $OUT/call2_same_bits.log; tail -n 1 $OUT/call2_same_bits.log
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_attention_gluon_gpu.py -k row_division \
  2>&1 | tail -n 3 | tee $OUT/call2_row_division_test.log
timeout 150 python3 $D/probe.py time --rep 20 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon element divide none atomic" "gluon row divide none atomic" "gluon element divide fp32_output det" \
  "gluon row divide fp32_output det" 2>&1 | grep -v Warning | tee $OUT/call2_time.log
