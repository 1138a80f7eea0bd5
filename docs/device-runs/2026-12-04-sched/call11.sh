#!/usr/bin/env bash
# nvidia-h200, the last call of the second 2026-12-04 session (about 270 s of device time left): the Gluon kernel's
# GPU tests on the final kernel code (its compiled test now has more tiles than programs), then an Nsight Compute
# profile of the new forward alone at (4,16,4096,128) (docs/device-runs/2026-12-02-gluon/profile.py). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_attention_gluon_gpu.py > $OUT/call11_gpu_gluon.log 2>&1
echo "gluon tests rc=$?"; tail -n 3 $OUT/call11_gpu_gluon.log
timeout 45 ncu --clock-control none -k regex:"_fwd_kernel" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
  python3 docs/device-runs/2026-12-02-gluon/profile.py 4,16,4096,128 > $OUT/call11_ncu_fwd.txt 2>&1
echo "ncu rc=$?"; grep -E "Duration|Throughput|Issue Slots|Pipe|Warp Cycles|Stall|Active" $OUT/call11_ncu_fwd.txt | head -30
