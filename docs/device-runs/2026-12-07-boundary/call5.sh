#!/usr/bin/env bash
# Call 5 of 2026-12-07 (boundary), third session, on commit bd1b5a6 (FWD_O_TMA and FWD_ROW_DIVIDE on: the kernel
# submitted; call5_machine.txt has its sha256), same warm machine: both together against the plain epilogue
# (same_bits.py) beside the GPU tier.
export PYTHONPATH=. TRITON_DEFAULT_FP_FUSION=1; sha256sum kernels/gluon_flash.py > $OUT/call5_machine.txt; nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/call5_machine.txt; (timeout 240 python3 docs/device-runs/2026-12-06-trace/same_bits.py "O by TMA + row divide" > $OUT/call5_same_bits.log 2>&1 &); bash docs/device-runs/gpu_tier.sh /tmp/tier5 240 2>&1 | tee $OUT/call5_summary.txt; sleep 3; tail -n 1 $OUT/call5_same_bits.log; grep -c "^ok" $OUT/call5_same_bits.log; (cd /tmp/tier5 && tar czf $OUT/call5_logs.tgz *.log)
