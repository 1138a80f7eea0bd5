#!/usr/bin/env bash
# Call 1 of 2026-12-08 (prepared 2026-12-07, third session; run it first, `run` with timeout_s 600):
#  1. the GPU tier on the submitted kernel (BWD_DQ_FIRST_STORE on since 2026-12-07-boundary call 6, whose tier got
#     no result), with the tests of the switches built since and off (BWD_ATOMIC_FIRST_STORE, BWD_DKV_TMA,
#     BWD_DQ_FINISH, FWD_LAG) each in a process of its own;
#  2. in one run, the ordered dQ (first share stored) against the atomic dQ, plain and with a stored first share
#     (BWD_ATOMIC_FIRST_STORE, built 2026-12-07, off; its GPU test is in the tier), both arms' numerics, 3 shapes,
#     cuDNN beside them (is the atomic order still the faster one?), and dK, dV by TMA (BWD_DKV_TMA, built
#     2026-12-07, off; its GPU test is in the tier), and dQ finished by its last add (BWD_DQ_FINISH, built
#     2026-12-08, off; ordered, and atomic behind a stored first share; its GPU test is in the tier);
#  3. where fwd+bwd's GPU time goes, kernel by kernel, for cuDNN and the Gluon kernel (benchmarks.kernel_profile,
#     added 2026-12-08).
# (GPT-2 small's training speed is call2.sh: both would not fit one call's 600 s.)
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } \
  > $OUT/call1_machine.txt
head -1 $OUT/call1_machine.txt
bash docs/device-runs/gpu_tier.sh /tmp/tier 240 2>&1 | tee $OUT/call1_summary.txt
(cd /tmp/tier && tar czf $OUT/call1_logs.tgz *.log)
timeout 240 python3 docs/device-runs/2026-12-08-trainer/probe.py time --rep 20 \
  --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon first store none det" "gluon first store none atomic" "gluon first store fp32_output det" \
  "gluon first store fp32_output atomic" "gluon atomic first store none atomic" \
  "gluon atomic first store fp32_output atomic" "gluon dK dV by TMA none det" \
  "gluon dK dV by TMA fp32_output det" "gluon dQ finished none det" "gluon dQ finished fp32_output det" \
  "gluon atomic first store dQ finished none atomic" "gluon atomic first store dQ finished fp32_output atomic" \
  2>&1 | grep -v Warning | tee $OUT/call1_time.log
timeout 90 python3 -m benchmarks.kernel_profile --backends gluon --modes fa2/none fa2/fp32_output --atomic-dq \
  --steps 10 --out $OUT/call1_kernels.md 2>&1 | grep -v Warning | tail -n 3
