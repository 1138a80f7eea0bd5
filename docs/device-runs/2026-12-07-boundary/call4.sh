#!/usr/bin/env bash
# Call 4 of 2026-12-07 (boundary), third session, on commit ecf3fe6 (FWD_O_TMA on, FWD_ROW_DIVIDE off), same warm
# machine: forward and fwd+bwd GPU time of the element division, the bf16 O by TMA, and both with the row division.
export PYTHONPATH=. TRITON_DEFAULT_FP_FUSION=1; git log --oneline | head -1; timeout 200 python3 docs/device-runs/2026-12-07-boundary/probe.py time --rep 30 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 --only "gluon element divide none atomic" "gluon O by TMA none atomic" "gluon O by TMA + row divide none atomic" "gluon element divide fp32_output det" "gluon O by TMA fp32_output det" "gluon O by TMA + row divide fp32_output det" "gluon O by TMA fp32_output atomic" 2>&1 | grep -v Warning | tee $OUT/call4_time.log
