# nvidia-h200, call D (warm, after call C): the attention benchmark on the shipped defaults (TMA off: dQ's pointer
# loads, and pointer atomics in the atomic backward) at the three shapes.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set +e
timeout 270 python3 -m benchmarks.attention --shapes 4,16,4096,128 2,16,4096,128 8,12,1024,64 \
  --modes fa2/none fa2/fp32_output paper/none --atomic-dq --rep-ms 40 --out $OUT/attention.md \
  > $OUT/attention.log 2>&1; echo "attention rc $?"; cat $OUT/attention.md; grep breakdown $OUT/attention.log | cut -c1-260
