#!/usr/bin/env bash
# Call 1 of 2026-12-05 (second session): (1) side by side, correctness: the probe's check of every Gluon case
# against fp64 with the FP32 O by TMA store (ordered dQ, bit-equal repeat), the Gluon kernel's GPU test file, and
# the trainer's compile-vs-eager tests with paper rounding (one failed in the first session's call 3 on a shared
# GPU; TRITON_PRINT_AUTOTUNING shows the tiles each run chose); (2) alone on the GPU: the FP32 O by TMA store
# against the plain stores, fa2/none beside them, SDPA cuDNN, both dQ orders. Logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-05-o32
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/call1_machine.txt
git log --oneline -1 | tee -a $OUT/call1_machine.txt
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
timeout 240 python3 $D/probe.py check --deterministic > $OUT/call1_check_det.log 2>&1 &
timeout 240 $P tests/gpu/test_attention_gluon_gpu.py > $OUT/call1_gpu_gluon.log 2>&1 &
TRITON_PRINT_AUTOTUNING=1 timeout 240 $P tests/gpu/test_train_gpu.py -k "trains_like_eager_with_triton_kernel and paper" \
  > $OUT/call1_gpu_train_paper.log 2>&1 &
wait
for f in $OUT/call1_check_det.log $OUT/call1_gpu_*.log; do echo "== $f"; grep -E "^(BAD|ERR|FAILED)|bad$" $f | head; tail -2 $f; done
timeout 280 python3 $D/probe.py time --rep 40 2>&1 | grep -v Warning | tee $OUT/call1_time.log
