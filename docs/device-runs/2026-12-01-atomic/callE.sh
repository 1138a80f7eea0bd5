# nvidia-h200, call E (fresh machine, no TE needed): after the interpreter-only _row_top2 change, the GPU attention
# tests of fa2's dynamic fixes (the code path next to it) and the atomic dQ tests of fa2/none.
export PYTHONUNBUFFERED=1
set +e
timeout 200 python3 -m pytest -q tests/gpu/test_attention_gpu.py -k "(fa2 and dynamic) or (atomic and fa2-none)" \
  -p no:cacheprovider -rf > $OUT/gpu_tests.log 2>&1; echo "tests rc $?"; tail -5 $OUT/gpu_tests.log
