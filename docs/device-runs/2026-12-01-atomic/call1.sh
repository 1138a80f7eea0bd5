# nvidia-h200, call 1 (no Transformer Engine needed): the atomic dQ backward's GPU tests, per-launch GPU times
# (deterministic with dQ's k/v via TMA or pointers; atomic dQ via a TMA reduction or pointer atomics), and the
# attention benchmark with and without the atomic backward at the three shapes.
export PYTHONUNBUFFERED=1 PYTHONPATH=.
set +e
python3 -c "import triton, triton.language as tl; print('triton', triton.__version__, 'descriptor atomics', hasattr(getattr(tl.core, 'tensor_descriptor_base', None), 'atomic_add'))"
timeout 150 python3 -m pytest -x -q tests/gpu/test_attention_gpu.py -k "atomic or tma" -p no:cacheprovider \
  > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -15 $OUT/gpu_tests.log
timeout 200 python3 docs/device-runs/2026-12-01-atomic/launch_times.py 4,16,4096,128 8,12,1024,64 \
  > $OUT/launch_times.log 2>&1; echo "launch times rc $?"; cat $OUT/launch_times.log
timeout 220 python3 -m benchmarks.attention --shapes 4,16,4096,128 2,16,4096,128 8,12,1024,64 \
  --modes fa2/none fa2/fp32_output paper/none --atomic-dq --rep-ms 40 --out $OUT/attention.md \
  > $OUT/attention.log 2>&1; echo "attention rc $?"; cat $OUT/attention.md; grep breakdown $OUT/attention.log
