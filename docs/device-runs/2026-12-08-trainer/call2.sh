#!/usr/bin/env bash
# Call 2 of 2026-12-08 (prepared 2026-12-07, third session; extended 2026-12-08; `run` with timeout_s 600 and carry
# ["data/cache/kjv"], built by `python -m launcher.prepare_data --out data/cache/kjv`):
#  1. GPT-2 small compiled, the fixed arm (fa2/fp32_output) per attention backend against the SDPA cuDNN trainer,
#     the issue's training target; the same command as 2026-12-05-o32's call 6. Writes gpt2_small.{log,json}.
#  2. at GPT-2 small's attention shape (8,12,1024,64), the Triton kernel (autotuned; what backend=auto runs at
#     head_dim 64) against the Gluon one (ordered and atomic dQ, with and without dQ finished in the backward), fix
#     none and fp32_output, cuDNN beside them: whether auto should take the Gluon kernel at head_dim 64 too;
#  3. the forward with consumer 1 lagging (FWD_LAG, built 2026-12-08, off; its GPU test is in call 1's tier), with
#     and without a K/V ring one stage deeper at head_dim 64, and with two Q slots, 3 shapes.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
GPT2_LIMIT=250 bash docs/device-runs/2026-12-03-gluon/call4.sh gpt2
timeout 120 python3 docs/device-runs/2026-12-08-trainer/probe.py time --rep 20 --shapes 8,12,1024,64 \
  --only "triton none det" "triton fp32_output det" "triton none atomic" "triton fp32_output atomic" \
  "gluon first store none det" "gluon first store fp32_output det" "gluon first store none atomic" \
  "gluon first store fp32_output atomic" "gluon dQ finished fp32_output det" \
  "gluon atomic first store dQ finished fp32_output atomic" 2>&1 | grep -v Warning | tee $OUT/call2_d64.log
timeout 170 python3 docs/device-runs/2026-12-08-trainer/probe.py time --rep 20 \
  --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "gluon first store none det" "gluon lag none det" "gluon lag 4 stages none det" "gluon 4 stages none det" \
  "gluon lag 2 Q slots none det" "gluon first store fp32_output det" "gluon lag fp32_output det" 2>&1 \
  | grep -v Warning | tee $OUT/call2_lag.log
