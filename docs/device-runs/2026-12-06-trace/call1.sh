#!/usr/bin/env bash
# Call 1 of 2026-12-06 (trace): SM-clock stamps in the Gluon forward's key-tile loop (gluon_trace.py, made by
# make_trace_kernel.py from kernels/gluon_flash.py), without and with the consumers' ping-pong, at the 1.3B shape
# class and GPT-2 small's; then Nsight Compute's per-instruction stall samples of the plain forward at
# (4,16,4096,128). Traces and logs in $OUT.
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
D=docs/device-runs/2026-12-06-trace
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; sha256sum kernels/gluon_flash.py $D/gluon_trace.py; } | tee $OUT/call1_machine.txt
timeout 200 python3 $D/trace.py run --out $OUT --shapes 4,16,4096,128 8,12,1024,64 4,16,2048,128 2>&1 | grep -v Warning | tee $OUT/call1_run.log
python3 $D/trace.py show $OUT/trace_*.pt > $OUT/call1_show.txt 2>&1; head -60 $OUT/call1_show.txt
timeout 150 ncu --clock-control none -k regex:"_fwd_kernel" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section ComputeWorkloadAnalysis \
  -o $OUT/call1_fwd python3 $D/trace.py forward 4,16,4096,128 > $OUT/call1_ncu.log 2>&1
echo "ncu rc=$?"; tail -3 $OUT/call1_ncu.log
ncu -i $OUT/call1_fwd.ncu-rep --page source --csv --print-source sass > $OUT/call1_fwd_sass.csv 2> $OUT/call1_sass_err.txt
echo "source page rc=$? $(wc -l < $OUT/call1_fwd_sass.csv) lines"; head -c 600 $OUT/call1_fwd_sass.csv; cat $OUT/call1_sass_err.txt | head -5
ncu -i $OUT/call1_fwd.ncu-rep --page details > $OUT/call1_fwd_details.txt 2>&1
grep -E "Duration|Throughput|Issue Slots|Warp Cycles|Stall" $OUT/call1_fwd_details.txt | head -20
