#!/usr/bin/env bash
# Call 1 of 2026-12-07 (boundary): the query-tile boundary of the Gluon forward, stamped (boundary.py).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call1_machine.txt
head -1 $OUT/call1_machine.txt
python3 $D/make_boundary_kernel.py
mkdir -p /tmp/boundary
timeout 120 python3 $D/boundary.py run --out /tmp/boundary --shapes 4,16,2048,128 8,12,1024,64 2>&1 \
  | grep -v Warning | tee $OUT/call1_run.log
python3 $D/boundary.py show /tmp/boundary/*.pt 2>&1 | tee $OUT/call1_show.txt
tar czf $OUT/call1_boundary.tgz -C /tmp boundary
