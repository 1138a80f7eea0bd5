#!/usr/bin/env bash
# Call 1 of 2026-12-07 (boundary), prepared: (1) side by side: same bits of the row division of O
# (FWD_ROW_DIVIDE) and of the rewritten cross-tile order (FWD_CROSS_TILE, two Q slots) against the default, each
# in its own process and time limit, and the Gluon GPU test file (which now compares the row division as well);
# (2) GPU time of the row division and the cross-tile order against the default, fp32_output (the fixed arm),
# next to SDPA cuDNN; (3) the stamped query-tile boundary, default and row division (boundary.py). Logs go
# straight to $OUT (8 files), in that order of worth.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-07-boundary
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call1_machine.txt
head -1 $OUT/call1_machine.txt
for variant in "row divide" "2 Q slots cross-tile"; do  # each alone: a hang costs only its result
  (timeout 200 python3 docs/device-runs/2026-12-06-trace/same_bits.py "$variant" 2>&1 | grep -v Warning \
    > "$OUT/call1_same_bits_${variant// /_}.log"; echo "exit ${PIPESTATUS[0]}" >> "$OUT/call1_same_bits_${variant// /_}.log") &
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/gpu/test_attention_gluon_gpu.py \
  > $OUT/call1_gpu_gluon.log 2>&1
wait
grep -E "BAD|same_bits|exit" $OUT/call1_same_bits_*.log; tail -n 1 $OUT/call1_gpu_gluon.log
timeout 180 python3 $D/probe.py time --rep 25 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "fp32_output det" 2>&1 | grep -v Warning | tee $OUT/call1_time.log
python3 $D/make_boundary_kernel.py
mkdir -p /tmp/boundary
timeout 120 python3 $D/boundary.py run --out /tmp/boundary --shapes 4,16,2048,128 8,12,1024,64 \
  --fixes fp32_output 2>&1 \
  | grep -v Warning | tee $OUT/call1_run.log
python3 $D/boundary.py show /tmp/boundary/*.pt 2>&1 | tee $OUT/call1_show.txt
tar czf $OUT/call1_boundary.tgz -C /tmp boundary
