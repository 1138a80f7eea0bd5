#!/usr/bin/env bash
# Call 3 of 2026-12-06 (trace), prepared and NOT run yet (device time ran out twice): two Q slots per consumer in
# the Gluon forward (FWD_Q_SLOTS = 2, "2 Q slots": the next tile's Q loads while this tile runs; the FP32 O by
# plain stores at head_dim 128, where the second slot takes the buffers' shared memory), and with it the next
# tile's first Q K^T issued before this tile's epilogue (FWD_CROSS_TILE, "2 Q slots cross-tile").
# (1) same bits as the default, each variant in its own process and time limit (a hang costs only its result);
# (2) the clock trace of the variants (the query-tile boundaries); (3) GPU time against the default, next to SDPA
# cuDNN; (4) the Gluon GPU test file. Everything goes into one tarball in $OUT (at most 8 files come back).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
L=/tmp/call3 && mkdir -p $L
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; git rev-parse HEAD 2>/dev/null;
  sha256sum kernels/*.py; } > $L/call3_machine.txt
head -1 $L/call3_machine.txt
for variant in "2 Q slots" "2 Q slots cross-tile" "1 Q slot cross-tile"; do
  timeout 40 python3 $D/same_bits.py "$variant" > $L/one.log 2>&1; rc=$?  # 124: timed out (a hang)
  grep -v Warning $L/one.log >> $L/call3_same_bits.log
  echo "$variant: exit $rc" | tee -a $L/call3_same_bits.log
done
grep -E "BAD|same_bits" $L/call3_same_bits.log
python3 $D/make_trace_kernel.py  # gluon_trace.py: the stamped copy of this tree's kernels/gluon_flash.py
timeout 100 python3 $D/trace.py run --out $L/traces --shapes 8,12,1024,64 4,16,2048,128 2>&1 | grep -v Warning \
  | tee $L/call3_trace_run.log
python3 $D/trace.py show $L/traces/trace_*.pt > $L/call3_show.txt 2>&1; grep -E "^==|step|boundary" $L/call3_show.txt
timeout 120 python3 $D/probe.py time --rep 25 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "none atomic" "fp32_output det" 2>&1 | grep -v Warning | tee $L/call3_time.log
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -x tests/gpu/test_attention_gluon_gpu.py > $L/call3_gpu_gluon.log 2>&1
tail -n 2 $L/call3_gpu_gluon.log
tar czf $OUT/call3.tgz -C /tmp call3
