#!/usr/bin/env bash
# Call 1 of 2026-12-06: the head_dim-64 forward with three consumer warpgroups (192-row tiles). (1) side by side,
# correctness: the probe's check of every Gluon case against fp64 (ordered dQ, bit-equal repeat) and the Gluon
# kernel's GPU test file (with the new test: two and three consumers give the same bits); (2) alone on the GPU:
# three consumers against two, the Triton kernel and SDPA cuDNN at head_dim 64 (the benchmark shape and GPT-2
# small's), and the head_dim-128 forward (its code gained the skipped-tile loop, never taken there). Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-d64
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/call1_machine.txt
git log --oneline -1 | tee -a $OUT/call1_machine.txt
sha256sum kernels/gluon_flash.py | tee -a $OUT/call1_machine.txt
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
timeout 240 python3 $D/probe.py check --deterministic > $OUT/call1_check_det.log 2>&1 &
timeout 240 $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call1_gpu_gluon.log 2>&1 &
wait
for f in $OUT/call1_check_det.log $OUT/call1_gpu_gluon.log; do echo "== $f"; grep -E "^(BAD|ERR|FAILED)|bad$" $f | head; tail -2 $f; done
timeout 150 python3 $D/probe.py time --rep 40 --shapes 8,12,1024,64 16,12,1024,64 2>&1 | grep -v Warning \
  | tee $OUT/call1_time_d64.log
timeout 90 python3 $D/probe.py time --rep 40 --shapes 4,16,2048,128 4,16,4096,128 --only "gluon none" \
  "gluon fp32_output" 2>&1 | grep -v Warning | tee $OUT/call1_time_d128.log
