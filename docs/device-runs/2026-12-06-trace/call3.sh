#!/usr/bin/env bash
# Call 3 of 2026-12-06 (trace): two Q slots per consumer in the Gluon forward (FWD_Q_SLOTS = 2: the next tile's Q
# loads while this tile runs; the FP32 O by plain stores at head_dim 128). (1) GPU time against one slot (the
# forward before), both dQ orders, next to SDPA cuDNN; (2) side by side: the probe's fp64 check of every Gluon case
# (ordered dQ, bit-equal repeat), the Gluon GPU file, the trainer file. Logs in $OUT (one archive: the device
# sends back at most 8 files).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
L=/tmp/call3; mkdir -p $L
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/*.py; } > $L/call3_machine.txt
head -1 $L/call3_machine.txt
timeout 160 python3 $D/probe.py time --rep 30 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 --only gluon 2>&1 \
  | grep -v Warning | tee $L/call3_time.log $OUT/call3_time.log
P="python3 -m pytest -q -p no:cacheprovider -rs --tb=short"
timeout 200 python3 $D/probe.py check --deterministic > $L/call3_check_det.log 2>&1 &
timeout 200 $P tests/gpu/test_attention_gluon_gpu.py > $L/call3_tier_gluon.log 2>&1 &
timeout 200 $P tests/gpu/test_train_gpu.py > $L/call3_tier_train.log 2>&1 &
wait
for f in $L/call3_check_det.log $L/call3_tier_*.log; do echo "== $(basename $f)"; grep -E "^(BAD|ERR|FAILED|ERROR)" $f | head -8; tail -n 1 $f; done
tar czf $OUT/call3_logs.tgz -C /tmp call3
