#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): what the epilogue's parts cost (epilogue.py: copies of the kernel with parts of
# the epilogue removed, timed against the intact one; wrong outputs, timing only). Log in $OUT. (The GPU tier was
# dropped from it when the session's device time ran short: it ran in call 1c.)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
timeout 150 python3 $D/epilogue.py --shapes 4,16,2048,128 8,12,1024,64 2>&1 | grep -v Warning \
  | tee $OUT/call2_epilogue.log
