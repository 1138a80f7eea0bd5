# nvidia-h200, call 1: per-launch GPU times of fa2 and paper before (2d40124's kernels, carried as .devcache/old) and
# after this session's paper changes (pass 1 on raw q.k, the backward's exponent as one FMA); then the GPU tests of
# the paper modes on the new kernels.
export PYTHONUNBUFFERED=1
set +e
S="docs/device-runs/2026-12-01-paper/paper_launches.py 8,12,1024,64 4,16,4096,128"
PYTHONPATH=.devcache/old timeout 200 python3 $S > $OUT/launches_old.log 2>&1; echo "old rc $?"; cat $OUT/launches_old.log
PYTHONPATH=. timeout 200 python3 $S > $OUT/launches_new.log 2>&1; echo "new rc $?"; cat $OUT/launches_new.log
PYTHONPATH=. timeout 170 python3 -m pytest -q -x tests/gpu/test_attention_gpu.py -k paper > $OUT/gpu_paper_tests.log 2>&1
echo "tests rc $?"; tail -5 $OUT/gpu_paper_tests.log
