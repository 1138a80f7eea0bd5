#!/usr/bin/env bash
# Call 3 of 2026-12-06 (trace), run on 2026-12-07 (README.md): two Q slots per consumer in
# the Gluon forward (FWD_Q_SLOTS = 2, "2 Q slots": the next tile's Q loads while this tile runs; the FP32 O by
# plain stores at head_dim 128, where the second slot takes the buffers' shared memory), and with it the next
# tile's first Q K^T issued before this tile's epilogue (FWD_CROSS_TILE, "2 Q slots cross-tile").
# (1) at once, side by side on the one GPU: same bits as the default, each variant in its own process and time
# limit (a hang costs only its result), and the Gluon GPU test file; (2) GPU time against the default, next to SDPA
# cuDNN, alone on the GPU; (3) the clock trace of the variants (the query-tile boundaries). Logs go straight to
# $OUT, in that order of worth, so that a call cut off at its limit still returns what it finished (8 files at most).
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; git rev-parse HEAD 2>/dev/null;
  sha256sum kernels/*.py; } > $OUT/call3_machine.txt
head -1 $OUT/call3_machine.txt
L=/tmp/call3 && mkdir -p $L
i=0
for variant in "2 Q slots" "2 Q slots cross-tile" "1 Q slot cross-tile"; do
  i=$((i + 1))
  ( timeout 90 python3 $D/same_bits.py "$variant" > $L/same_bits_$i.log 2>&1
    echo "$variant: exit $?" >> $L/same_bits_$i.log ) &  # exit 124: timed out (a hang)
done
timeout 90 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/gpu/test_attention_gluon_gpu.py \
  > $OUT/call3_gpu_gluon.log 2>&1 &
wait
cat $L/same_bits_*.log | grep -v Warning > $OUT/call3_same_bits.log
grep -E "BAD|same_bits|exit" $OUT/call3_same_bits.log; tail -n 1 $OUT/call3_gpu_gluon.log
timeout 150 python3 $D/probe.py time --rep 25 --shapes 8,12,1024,64 4,16,2048,128 4,16,4096,128 \
  --only "none atomic" "fp32_output det" 2>&1 | grep -v Warning | tee $OUT/call3_time.log
python3 $D/make_trace_kernel.py  # gluon_trace.py: the stamped copy of this tree's kernels/gluon_flash.py
timeout 100 python3 $D/trace.py run --out $L/traces --shapes 8,12,1024,64 4,16,2048,128 2>&1 | grep -v Warning \
  | tee $OUT/call3_trace_run.log
python3 $D/trace.py show $L/traces/trace_*.pt > $OUT/call3_show.txt 2>&1; grep -E "^==|step|boundary" $OUT/call3_show.txt
tar czf $OUT/call3_traces.tgz -C $L traces
