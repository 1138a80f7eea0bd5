#!/usr/bin/env bash
# Call 2 of 2026-12-07 (boundary): what the epilogue's parts cost (epilogue.py: copies of the kernel with parts of
# the epilogue removed, timed against the intact one; wrong outputs, timing only), then the stamped boundary for
# fa2/none (call 1b stamped fp32_output). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call2_machine.txt
head -1 $OUT/call2_machine.txt
timeout 240 python3 $D/epilogue.py --shapes 4,16,2048,128 8,12,1024,64 4,16,4096,128 2>&1 | grep -v Warning \
  | tee $OUT/call2_epilogue.log
python3 $D/make_boundary_kernel.py
mkdir -p /tmp/boundary
timeout 120 python3 $D/boundary.py run --out /tmp/boundary --shapes 4,16,2048,128 8,12,1024,64 --fixes none 2>&1 \
  | grep -v Warning > $OUT/call2_run.log
python3 $D/boundary.py show /tmp/boundary/*.pt 2>&1 | tee $OUT/call2_show.txt
tar czf $OUT/call2_boundary.tgz -C /tmp boundary
